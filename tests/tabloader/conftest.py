from __future__ import annotations

import shutil

import pytest

import catalog
from tabloader.datagen import corrupt_image


@pytest.fixture
def images(image_cat_dir):
    """An open catalog holding ``image_folder`` as ``imgs`` (this test's own copy)."""
    cat = catalog.open_catalog(image_cat_dir)
    yield cat
    cat.close()


@pytest.fixture
def corrupt(tmp_path, image_folder):
    """``images`` with one JPEG corrupted before the import: (catalog, that row's ``_id``)."""
    folder = tmp_path / "folder"
    shutil.copytree(image_folder, folder)
    victim = sorted(folder.rglob("*.jpg"))[0]
    corrupt_image(victim)
    cat = catalog.open_catalog(tmp_path / "cat")
    ds = cat.import_imagefolder("imgs", folder)
    paths = ds.take(list(range(ds.num_rows)), ["path"]).column("path").to_pylist()
    yield cat, paths.index(victim.relative_to(folder).as_posix())
    cat.close()


@pytest.fixture(params=["kernel", "torch", "pillow"])
def resizer(request, monkeypatch):
    """Each way a resize is computed: tabloader's kernel; torch where the kernel was not
    built; Pillow where torch is missing too."""
    from tabloader.engine import resample

    if request.param != "kernel":
        monkeypatch.setattr(resample, "_kernel", None)
    if request.param == "pillow":
        monkeypatch.setattr(resample, "optional_torch", lambda: None)
    resample.resampler.cache_clear()
    yield request.param
    resample.resampler.cache_clear()
