from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from skewserve.ports import PORT_RANGE_ENV
from skewserve.triton_dist import PreparedTriton, prepare_triton
from tests.fixtures_models import write_affine_model

# Each pytest-xdist worker (and a run without xdist, as worker 0) draws the ports of the servers its
# tests start from a block of its own below the kernel's ephemeral range: no other worker, and no
# `bind(0)` or outgoing connection anywhere on the machine, can take a port between its choice and
# the server's bind (skewserve/ports.py).
_PORTS_BELOW = 10_000
_PORTS_PER_WORKER = 1_500


def _worker_port_range() -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    low = _PORTS_BELOW + index * _PORTS_PER_WORKER
    high = low + _PORTS_PER_WORKER - 1
    if high >= ephemeral_low:
        raise RuntimeError(
            f"pytest-xdist worker {worker}: its ports {low}-{high} reach the kernel's ephemeral range "
            f"(from {ephemeral_low}); run with fewer workers (-n)"
        )
    return f"{low}-{high}"


os.environ[PORT_RANGE_ENV] = _worker_port_range()


@pytest.fixture(scope="session")
def prepared_triton(tmp_path_factory: pytest.TempPathFactory) -> PreparedTriton:
    # One prepared copy for the whole run: the workers' temporary roots share a parent, and
    # prepare_triton renames a finished copy into place, so concurrent workers never see half of one.
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    os.environ.setdefault("SKEWSERVE_CACHE_DIR", str(shared / "triton-cache"))
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


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.synth import SynthSpec, write

    d = tmp_path_factory.mktemp("lt_data")
    write(
        SynthSpec(
            n_classes=5,
            imbalance_ratio=20,
            n_max=400,
            n_features=8,
            n_informative=6,
            n_val_per_class=40,
            n_test_per_class=40,
            seed=2,
        ),
        d,
    )
    return d


@pytest.fixture(scope="session")
def small_artifact(tmp_path_factory: pytest.TempPathFactory, small_data: Path) -> Path:
    """A real (small) trained artifact, shared by exporter and gateway tests."""
    from training.config import TrainConfig
    from training.launch import train

    out = tmp_path_factory.mktemp("artifact") / "art"
    train(TrainConfig(data_dir=small_data, out_dir=out, epochs=4, width=32, progress=False))
    return out


@pytest.fixture(scope="session")
def gateway_repo(small_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository with `lt` (cache opted in by gateway tests) and `lt_nocache`."""
    from exporter.pipeline import export_artifact

    repo = tmp_path_factory.mktemp("gw_repo")
    export_artifact(small_artifact, repo, "lt", tensorrt="off")
    export_artifact(small_artifact, repo, "lt_nocache", tensorrt="off")
    return repo


# In CI every real component is installed (the Makefile installs what pip and apt carry; kubectl
# comes with the CI image), so a skip there means one is missing and its tests silently did not run:
# that fails. The one allowed skip is a GPU-only path on
# a machine without a GPU, and its reason says so.
_GPU_SKIP_WORDS = ("gpu", "cuda", "tensorrt")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure is not a missing component
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if any(word in reason.lower() for word in _GPU_SKIP_WORDS):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in CI ({reason}): CI installs every real component, so this skip means one is "
        "missing; install it from the Makefile (apt or pip) instead of skipping"
    )
