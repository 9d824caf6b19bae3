from __future__ import annotations

import io
import sys

import pyarrow as pa
import pytest

from tabloader.catalog import _progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _bars_enabled(monkeypatch):
    """Undo conftest's silencing; each test then picks its stderr (in the test body, since
    pytest's capture replaces sys.stderr again between fixture setup and the test call)."""
    monkeypatch.delenv("TABLOADER_DISABLE_PROGRESS_BARS")
    _progress.enable_progress_bars()


def test_import_shows_a_bar_on_a_terminal(cat, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stderr := FakeTerminal())
    cat.import_arrow("t", pa.table({"x": list(range(1000))}))
    assert "import t:   0%" in stderr.getvalue()
    assert "/1.00k [" in stderr.getvalue()  # the source's row count is the total


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_env_var_silences_bars(cat, monkeypatch, value):
    monkeypatch.setenv("TABLOADER_DISABLE_PROGRESS_BARS", value)
    monkeypatch.setattr(sys, "stderr", stderr := FakeTerminal())
    cat.import_arrow("t", pa.table({"x": [1, 2]}))
    assert stderr.getvalue() == ""


def test_disable_progress_bars_silences_bars(cat, monkeypatch):
    _progress.disable_progress_bars()
    monkeypatch.setattr(sys, "stderr", stderr := FakeTerminal())
    cat.import_arrow("t", pa.table({"x": [1, 2]}))
    assert stderr.getvalue() == ""


def test_no_bar_when_stderr_is_not_a_terminal(cat, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stderr := io.StringIO())
    cat.import_arrow("t", pa.table({"x": [1, 2]}))
    assert stderr.getvalue() == ""
