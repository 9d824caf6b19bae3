"""A statement's parser (sqlglot: 0.15-0.35 s to import) costs neither a client's REGISTER JOB
nor the service's first statement: the client sends a statement that cannot carry a path
unparsed, and an idle service imports the parser before its first statement comes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent(
    """
    import sys
    from tabloader.service import _catalog_ops as ops
    from tabloader.service import _server as server

    text = "REGISTER OR REPLACE JOB j SELECT image FROM imgs WHERE label % 3 <> 0"
    assert ops.absolute_paths(text) == text
    print("client:", "sqlglot" in sys.modules)
    server._warm_statements()
    print("warmed:", "sqlglot" in sys.modules)
    """
)


def test_a_register_is_sent_unparsed_and_the_service_warms_the_parser():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.split("\n")[:2] == ["client: False", "warmed: True"]


@pytest.mark.parametrize("verb", ["CREATE DATASET d FROM", "append to dataset d from"])
def test_a_relative_path_is_still_made_absolute(verb, tmp_path, monkeypatch):
    from tabloader.service._catalog_ops import absolute_paths

    monkeypatch.chdir(tmp_path)
    assert absolute_paths(f"{verb} 'rows.parquet'") == f"{verb} '{tmp_path / 'rows.parquet'}'"
