from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from skewserve.triton_dist import PreparedTriton, prepare_triton
from tests.fixtures_models import write_affine_model


@pytest.fixture(scope="session")
def prepared_triton(tmp_path_factory: pytest.TempPathFactory) -> PreparedTriton:
    os.environ.setdefault("SKEWSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return prepare_triton()


@pytest.fixture(scope="session")
def affine_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("affine_repo")
    write_affine_model(repo, "affine", scale=2.0)
    return repo


@pytest.fixture()
def log_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "logs"
    d.mkdir()
    yield d
