"""The C extensions: each stub says exactly what its built module exposes (names, signatures,
docstrings, constants' types), and each source builds without a warning under -Wall -Wextra,
the resize kernel's portable C alone (what a CPU other than x86 compiles) too."""

from __future__ import annotations

import ast
import importlib
import inspect
import shlex
import shutil
import subprocess
import sysconfig
import typing
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = ["tabloader.engine._prepare._resample", "tabloader.sampling._rounds"]
KINDS = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonlyargs": inspect.Parameter.KEYWORD_ONLY,
}


def source(name: str, suffix: str) -> Path:
    return ROOT / (name.replace(".", "/") + suffix)


def built(name: str) -> ModuleType:
    """The built module (a C compiler is part of the test setup, as in test_the_c_walk_is_built)."""
    return importlib.import_module(name)


def stub(name: str) -> ast.Module:
    return ast.parse(source(name, ".pyi").read_text())


def stub_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """The names a stub declares: its functions and annotated constants (not its imports)."""
    names: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def stub_signature(fn: ast.FunctionDef) -> inspect.Signature:
    """The stub function's parameters, names and kinds (C functions have no annotations)."""
    params = [
        inspect.Parameter(arg.arg, kind)
        for field, kind in KINDS.items()
        for arg in getattr(fn.args, field)
    ]
    if fn.args.vararg:
        params.append(inspect.Parameter(fn.args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    if fn.args.kwarg:
        params.append(inspect.Parameter(fn.args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    params.sort(key=lambda p: p.kind)  # keyword-only after *args, as in the source
    return inspect.Signature(params)


def conforms(value: object, annotation: str) -> bool:
    """``value`` is of the stub's ``annotation`` (the builtin types and their generics)."""
    hint = eval(annotation, {"tuple": tuple, "int": int, "str": str, "float": float})
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if not isinstance(value, origin):
        return False
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return all(isinstance(v, args[0]) for v in value)
    return not args


@pytest.mark.parametrize("name", EXTENSIONS)
def test_a_stub_declares_every_public_name_of_its_module_and_no_other(name):
    public = {n for n in vars(built(name)) if not n.startswith("_")}
    assert set(stub_names(stub(name))) == public


@pytest.mark.parametrize("name", EXTENSIONS)
def test_a_stubs_functions_have_the_modules_signatures_and_docstrings(name):
    mod, tree = built(name), stub(name)
    assert ast.get_docstring(tree) == inspect.getdoc(mod)
    functions = [n for n in stub_names(tree).values() if isinstance(n, ast.FunctionDef)]
    assert functions
    for fn in functions:
        obj = getattr(mod, fn.name)
        assert obj.__text_signature__, f"{name}.{fn.name}'s C docstring has no signature line"
        assert inspect.signature(obj) == stub_signature(fn), fn.name
        assert inspect.getdoc(obj) == ast.get_docstring(fn), fn.name


@pytest.mark.parametrize("name", EXTENSIONS)
def test_a_stubs_constants_have_the_modules_types(name):
    mod = built(name)
    for node in stub_names(stub(name)).values():
        if isinstance(node, ast.AnnAssign):
            value = getattr(mod, node.target.id)
            assert conforms(value, ast.unparse(node.annotation)), (node.target, value)


def test_the_stub_check_sees_a_drift():
    """The checks above fail on a stub that has drifted: a renamed parameter, a keyword
    parameter where C takes it positionally, another docstring, a constant's type."""
    fn = ast.parse("def rounds(regions, order, /): 'Run rounds.'").body[0]
    assert isinstance(fn, ast.FunctionDef)
    renamed = ast.parse("def rounds(regions, orders, /): ...").body[0]
    keyword = ast.parse("def rounds(regions, order): ...").body[0]
    assert stub_signature(fn) != stub_signature(renamed)
    assert stub_signature(fn) != stub_signature(keyword)
    assert ast.get_docstring(fn) != inspect.getdoc(built(EXTENSIONS[1]).rounds)
    assert conforms(("avx2", "scalar"), "tuple[str, ...]")
    assert not conforms(("avx2", 1), "tuple[str, ...]")
    assert not conforms(1, "tuple[str, ...]")


def unix_flags() -> list[str]:
    """setup.py's UNIX_FLAGS (read, not imported: importing it runs setup())."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "UNIX_FLAGS":
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no UNIX_FLAGS")


@pytest.mark.parametrize(
    ("name", "defines"),
    [(EXTENSIONS[0], []), (EXTENSIONS[0], ["-DRS_PORTABLE"]), (EXTENSIONS[1], [])],
    ids=["resample", "resample-portable", "rounds"],
)
def test_builds_without_a_warning(name, defines, tmp_path):
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]})")
    argv = [
        *cc,
        *unix_flags(),
        "-Werror",
        "-fPIC",
        *defines,
        "-I",
        sysconfig.get_paths()["include"],
        "-c",
        str(source(name, ".c")),
        "-o",
        str(tmp_path / "out.o"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
