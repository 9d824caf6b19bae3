"""Tests reach tabloader's private names only through the hooks named in
``tests.support.hooks.TEST_HOOKS``.

A private name is an ``_``-prefixed name (not a dunder) that tabloader's source defines (a
function, class, variable or attribute; a C extension's names come from its ``.pyi`` stub). A
test reads one as an attribute (``loader._lock``), an imported name (``from m import _helper``),
a string given to ``getattr``/``setattr``/``delattr``/``hasattr``/``patch.object``, or the last
part of a dotted string given to ``monkeypatch.setattr``/``mock.patch``
(``"tabloader.x._y"``). A private *module* is not a private name: importing
``tabloader.engine._arena.shm`` is how a test reaches internals in this layout. Reads through
``self``/``cls`` are a test class's own.

Run as a script (``python tests/test_private_reads.py``) it prints every read, by name.
"""

from __future__ import annotations

import ast
import collections
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from tests.support.hooks import MAX_TEST_HOOKS, TEST_HOOKS  # noqa: E402

NAMED_BY_STRING = {"getattr", "setattr", "delattr", "hasattr", "object"}  # (obj, "_name", ...)
PATCHERS = {"setattr", "delattr", "patch"}  # ("tabloader.module._name", ...)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def defined_names() -> frozenset[str]:
    """Every ``_``-prefixed name tabloader's source or its extensions' stubs define."""
    names: set[str] = set()
    for path in [*(ROOT / "tabloader").rglob("*.py"), *(ROOT / "tabloader").rglob("*.pyi")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return frozenset(n for n in names if is_private(n))


def is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of this checkout (or a C extension)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file() or path.with_suffix(".pyi").is_file()


def dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` as a module path, its first name resolved through the file's imports."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        head = dotted(node.value, aliases)
        return None if head is None else f"{head}.{node.attr}"
    return None


def module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the module it stands for, from ``import a.b as c`` and ``from a import b``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def named_by_string(call: ast.Call, private: frozenset[str] | set[str]) -> list[str]:
    """The private name a call names in a string: ``getattr(obj, "_x")``,
    ``monkeypatch.setattr("tabloader.m._x", ...)``."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    args = [a.value if isinstance(a, ast.Constant) else None for a in call.args[:2]]
    if called in NAMED_BY_STRING and len(args) == 2 and args[1] in private:
        return [args[1]]
    head = args[0] if args else None
    if called in PATCHERS and isinstance(head, str) and head.startswith("tabloader."):
        name = head.rsplit(".", 1)[1]
        if name in private and not is_module(head):
            return [name]
    return []


def reads_in(tree: ast.Module, private: frozenset[str] | set[str]) -> list[tuple[str, int]]:
    """(name, line) of every private name ``tree`` reads."""
    aliases = module_aliases(tree)
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            path = dotted(node, aliases)
            if path is None or not is_module(path):
                found.append((node.attr, node.lineno))
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tabloader")
        ):
            for a in node.names:
                if a.name in private and not is_module(f"{node.module}.{a.name}"):
                    found.append((a.name, node.lineno))
        elif isinstance(node, ast.Call):
            found += [(name, node.lineno) for name in named_by_string(node, private)]
    return found


@functools.cache
def private_reads() -> dict[str, list[str]]:
    """Private name -> every ``file:line`` of tests/ that reads it."""
    private = defined_names()
    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT)
        for name, line in reads_in(ast.parse(path.read_text(), str(path)), private):
            where[name].append(f"{rel}:{line}")
    return dict(where)


def test_tests_read_private_names_only_through_the_listed_hooks():
    unlisted = [
        f"{at} reads {name}"
        for name, ats in private_reads().items()
        if name not in TEST_HOOKS
        for at in ats
    ]
    assert not unlisted, (
        "tests read private names that tests/support/hooks.py's TEST_HOOKS does not list (go "
        "through a public API, make a collaborator's attribute public inside its private module, "
        "or add a hook with its reason):\n" + "\n".join(unlisted)
    )


def test_the_hook_list_is_short_and_every_hook_is_used():
    assert len(TEST_HOOKS) <= MAX_TEST_HOOKS, (
        f"{len(TEST_HOOKS)} test hooks; at most {MAX_TEST_HOOKS}"
    )
    unused = sorted(set(TEST_HOOKS) - set(private_reads()))
    assert not unused, f"TEST_HOOKS lists names no test reads (remove them): {unused}"
    private = defined_names()
    assert all(name in private for name in TEST_HOOKS), (
        "TEST_HOOKS lists a name tabloader no longer defines"
    )
    assert all(reason.strip() for reason in TEST_HOOKS.values()), (
        "each hook says why a test needs it"
    )


def test_the_walk_finds_each_form_of_read():
    """The finder itself can fail: each form of read in a made-up test is found, and a private
    module, a dunder, a test's own attribute and a name tabloader does not define are not."""
    source = """
import tabloader.engine._arena.shm as shm
from tabloader.engine._queue import sched
from tabloader.engine._arena import shm as arena_shm
from tabloader.x import _helper
loader._lock
getattr(loader, "_first")
monkeypatch.setattr(obj, "_count", 1)
mock.patch.object(obj, "_pool")
monkeypatch.setattr("tabloader.service._server._SERVE", 2)
sched._set_horizons
self._lock
loader.__dict__
loader._not_defined_by_tabloader
arena_shm.shm_available
"""
    private = {"_helper", "_lock", "_first", "_count", "_pool", "_SERVE", "_set_horizons"}
    got = sorted(reads_in(ast.parse(source), private), key=lambda r: r[1])
    assert got == [
        ("_helper", 5),
        ("_lock", 6),
        ("_first", 7),
        ("_count", 8),
        ("_pool", 9),
        ("_SERVE", 10),
        ("_set_horizons", 11),
    ]
    assert not reads_in(
        ast.parse(
            "from tabloader.engine import _arena\nimport tabloader.engine._arena\n"
            "tabloader.engine._arena.shm\n"
        ),
        {"_arena"},
    )


if __name__ == "__main__":
    reads = private_reads()
    print("total", sum(map(len, reads.values())), "distinct", len(reads))  # noqa: T201
    for name, ats in sorted(reads.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        hook = "" if name in TEST_HOOKS else " (not a hook)"
        print(f"{len(ats):4d} {name}{hook}: {', '.join(ats)}")  # noqa: T201
