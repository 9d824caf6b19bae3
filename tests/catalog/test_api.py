"""``tabloader.catalog._api``: one table of the catalog's operations drives every implementation."""

from __future__ import annotations

import inspect
from typing import Any

import pyarrow as pa
import pytest

from tabloader.catalog._api import OPERATIONS, Arg, CatalogAPI, Operation, Wire, operation
from tabloader.catalog._catalog import Catalog


def test_the_catalog_implements_every_operation_of_the_table():
    assert {"sql", "dataset", "job", "register_job", "import_path", "verify"} <= set(OPERATIONS)
    for name, op in OPERATIONS.items():
        own = getattr(Catalog, name)
        assert own is not getattr(CatalogAPI, name), f"Catalog does not implement {name}"
        # the table's arguments are the signature's, by position before the * (an
        # implementation may name those otherwise: Catalog.sql's is ``text``)
        params = list(inspect.signature(own).parameters.values())[1:]
        assert len(params) == len(op.args), name
        keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert keywords == [n for n, _ in op.args[op.positional :]], name


def test_each_argument_crosses_the_wire_as_its_type_says_unless_the_row_names_its_kind():
    kinds = {name: dict(op.args) for name, op in OPERATIONS.items()}
    assert kinds["register_job"] == {
        "name": Arg.STR,
        "dataset": Arg.STR,
        "columns": Arg.COLUMNS,
        "where": Arg.WHERE,
        "options": Arg.OPTIONS,
        "replace": Arg.BOOL,
    }
    assert kinds["import_path"]["path"] is Arg.PATH
    assert kinds["sql"] == {"statement": Arg.STATEMENT}  # a str, named in its row


def test_an_argument_of_a_type_with_no_wire_kind_is_refused_at_import():
    with pytest.raises(TypeError, match=r"argument key's type 'float' says no wire kind"):

        class Broken(CatalogAPI):
            @operation(Wire.NAMES)
            def look(self, key: float) -> list[str]:
                raise AssertionError

    assert "look" not in OPERATIONS


def test_a_row_naming_an_argument_the_signature_lacks_is_refused_at_import():
    with pytest.raises(TypeError, match=r"@operation of look: it has no argument \['name'\]"):

        class Broken(CatalogAPI):
            @operation(Wire.NAMES, name=Arg.STR)
            def look(self, key: str) -> list[str]:
                raise AssertionError

    assert "look" not in OPERATIONS


class Recorder(CatalogAPI):
    """An implementation driven by the table: it records what each operation was given."""

    root: Any = None
    exists = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _perform(self, op: Operation, arguments: dict[str, Any]) -> Any:
        self.calls.append((op.name, arguments))
        return [] if op.result is Wire.NAMES else op.name

    def close(self) -> None:
        pass


def test_an_implementation_gets_each_operation_as_one_call_with_its_row():
    api = Recorder()
    assert api.job("j") == "job"
    api.dataset("d", version=2)
    api.register_job("j", "d", where="x < 3")
    api.import_parquet("p", "/data/p.parquet", follow_links=True)
    assert api.datasets() == []  # built on dataset_names
    assert api.calls == [
        ("job", {"name": "j"}),
        ("dataset", {"name": "d", "version": 2}),
        (
            "register_job",
            {
                "name": "j",
                "dataset": "d",
                "columns": None,
                "where": "x < 3",
                "options": None,
                "replace": False,
            },
        ),
        (
            "import_path",
            {
                "name": "p",
                "path": "/data/p.parquet",
                "format": "parquet",
                "append": False,
                "follow_links": True,
                "split": None,
                "storage": None,
            },
        ),
        ("dataset_names", {}),
    ]
    with pytest.raises(TypeError, match="unexpected keyword argument 'versoin'"):
        api.dataset("d", versoin=2)  # type: ignore[call-arg]


def test_operation_call_runs_it_on_a_catalog(tmp_path):
    with Catalog(tmp_path / "c", create=True) as cat:
        cat.import_arrow("t", pa.table({"x": [1, 2, 3]}))
        statement = OPERATIONS["sql"].call(cat, {"statement": "SELECT sum(x) AS s FROM t"})
        assert statement.to_pydict() == {"s": [6]}
        assert OPERATIONS["dataset"].call(cat, {"name": "t", "version": None}).num_rows == 3


def test_one_way_to_open_a_catalog_each_face(tmp_path):
    import tabloader
    from tabloader import catalog
    from tabloader.service import _connection as connection

    with pytest.raises(AttributeError, match="has no attribute 'connect'"):
        catalog.connect  # noqa: B018  (the deprecated name is gone)
    assert "connect" not in catalog.__all__
    assert "open_catalog" in catalog.__all__
    # one public connect: tabloader's (through the service while one runs)
    assert tabloader.connect is connection.connect
    assert "open_catalog" not in tabloader.__all__
