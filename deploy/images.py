"""Pin every image the Kubernetes overlays run to its registry digest.

Builds and pushes the gateway image (the controller runs from it too) to REGISTRY, asks the registry
for the digest of each image named in deploy/k8s/base/kustomization.yaml (`images:`), writes those
digests there (every overlay inherits them) and prints them. A rebuild under the same tag therefore
changes the manifests, and `kubectl apply` rolls exactly the pods whose bytes changed.

    make images REGISTRY=registry.example.com/skewserve          # build, push, pin
    make images REGISTRY=registry.example.com/skewserve BUILD=0  # pin what the registry holds now

Digests come from `crane digest` where crane is installed, else `docker buildx imagetools inspect`
(neither pulls the image). Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZATION = ROOT / "deploy" / "k8s" / "base" / "kustomization.yaml"
GATEWAY = "skewserve-gateway"  # the kustomize image name the gateway and controller use
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class ImagesError(Exception):
    """A step failed; the message says which and what to do."""


def run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ImagesError(
            f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}"
        )
    return res.stdout


def resolver() -> list[str]:
    """The command that prints a pushed image's digest without pulling it."""
    if crane := shutil.which("crane"):
        return [crane, "digest"]
    if docker := shutil.which("docker"):
        return [docker, "buildx", "imagetools", "inspect", "--format", "{{json .Manifest}}"]
    raise ImagesError("neither crane nor docker is installed: install one (crane: go-containerregistry)")


def digest_of(reference: str, command: list[str]) -> str:
    out = run([*command, reference]).strip()
    if out.startswith("{"):  # docker buildx imagetools: the manifest (or index) descriptor
        out = str(json.loads(out).get("digest", ""))
    if not DIGEST.fullmatch(out):
        raise ImagesError(f"{reference}: the registry answered {out!r}, not a sha256 digest")
    return out


def entries(text: str) -> dict[str, dict[str, str]]:
    """name -> {newName, newTag, digest} of the `images:` list, read line by line (the file's
    comments are part of the deployment's documentation and must survive the rewrite)."""
    out: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.split("images:", 1)[1].splitlines():
        if m := re.match(r"\s+- name: (\S+)", line):
            current = out.setdefault(m.group(1), {})
        elif (m := re.match(r"\s+(newName|newTag|digest): (\S+)", line)) and current is not None:
            current[m.group(1)] = m.group(2)
    return out


def rewrite(text: str, name: str, field: str, value: str) -> str:
    """Set `field` of the `images:` entry `name`, keeping every other line as it is."""
    head, images = text.split("images:", 1)
    block = re.compile(rf"(\n\s+- name: {re.escape(name)}\n(?:\s+(?!- )\w+: \S+\n)*?\s+{field}: )(\S+)")
    images, count = block.subn(lambda m: m.group(1) + value, images)
    if count != 1:
        raise ImagesError(f"{KUSTOMIZATION}: images entry {name!r} has no {field} line to set")
    return head + "images:" + images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--registry", required=True, help="where the gateway image is pushed, e.g. ghcr.io/you"
    )
    parser.add_argument("--build", type=int, default=1, help="0: do not build or push the gateway image")
    parser.add_argument("--kustomization", type=Path, default=KUSTOMIZATION)
    args = parser.parse_args(argv)
    try:
        if not args.registry.strip("/"):
            raise ImagesError("REGISTRY is empty: make images REGISTRY=registry.example.com/skewserve")
        path: Path = args.kustomization
        text = path.read_text()
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        gateway = f"{args.registry.rstrip('/')}/skewserve-gateway"
        text = rewrite(text, GATEWAY, "newName", gateway)
        text = rewrite(text, GATEWAY, "newTag", version)
        if args.build:
            docker = shutil.which("docker")
            if docker is None:
                raise ImagesError("docker is needed to build the gateway image (or BUILD=0 to pin only)")
            ref = f"{gateway}:{version}"
            # --pull: the base image's tag may have moved to a patched build since the last one
            run([docker, "build", "--pull", "-f", "deploy/gateway.Dockerfile", "-t", ref, str(ROOT)])
            run([docker, "push", ref])
        command = resolver()
        pinned = []
        for name, image in entries(text).items():
            reference = f"{image['newName']}:{image['newTag']}"
            digest = digest_of(reference, command)
            text = rewrite(text, name, "digest", digest)
            pinned.append((name, f"{reference}@{digest}"))
        path.write_text(text)
    except ImagesError as exc:
        print(f"make images: {exc}", file=sys.stderr)
        return 2
    width = max(len(n) for n, _ in pinned)
    for name, ref in pinned:
        print(f"{name:<{width}}  {ref}")
    print(f"written to {path}; check with `make deploy-check` before applying")
    return 0


if __name__ == "__main__":
    sys.exit(main())
