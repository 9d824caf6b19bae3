"""The loading side refuses a directory that is not a catalog, and creates nothing there."""

from __future__ import annotations

import pytest

import tabloader
from tabloader import Loader
from tabloader.catalog import CatalogError


def test_loader_refuses_a_directory_that_is_not_a_catalog(tmp_path):
    root = tmp_path / "typo"
    with pytest.raises(CatalogError, match=rf"'{root}' is not a tabloader catalog"):
        Loader(root, cache_bytes=1 << 20)
    assert not root.exists()
    with pytest.raises(CatalogError, match="is not a tabloader catalog"):
        tabloader.default_loader(root)
    # the refused Loader released the directory: it can be opened (and created) now
    with tabloader.connect(root, create=True) as cat:
        assert cat.exists


def test_job_dataset_refuses_a_directory_that_is_not_a_catalog(tmp_path):
    torch_api = pytest.importorskip("tabloader.torch")
    root = tmp_path / "typo"
    with pytest.raises(CatalogError, match=rf"'{root}' is not a tabloader catalog .*create=True"):
        torch_api.JobDataset("cnn", catalog=root)
    assert not root.exists()  # no service was started, no socket folder made


def test_unknown_job_names_the_catalog(cat):
    import pyarrow as pa

    cat.import_arrow("t", pa.table({"x": [1, 2]}))
    with (
        Loader(cat, cache_bytes=1 << 20) as loader,
        pytest.raises(LookupError, match=f"Unknown job 'cnn' in catalog '{cat.root}'"),
    ):
        loader.open("cnn")
