from __future__ import annotations

import pytest

import catalog


@pytest.fixture
def images(tmp_path, image_folder):
    cat = catalog.connect(tmp_path / "cat")
    cat.import_imagefolder("imgs", image_folder)
    yield cat
    cat.close()
