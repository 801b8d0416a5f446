"""A model's serving backend, kept per model so that it never flips with the exporting host.

`config.pbtxt` is model-level: every version of a model is loaded with it. Were its backend chosen
per export (a plan on a GPU host, ONNX on a CPU host), exporting version 2 on another machine would
make Triton look for `1/model.plan` in a version that has only `model.onnx`. So the backend is
recorded once, in `<model>/serving_backend.json`, and a publish that would change it is refused
unless asked for explicitly (`--change-backend`), and even then while a version that stays live
under the version policy lacks the files the new backend loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from repository.errors import PublishError
from repository.model_config import BACKENDS, backend_of, parse, required_files

BACKEND_FILE = "serving_backend.json"


def parse_backend_file(text: str, where: str) -> str:
    backend = json.loads(text).get("backend")
    if backend not in BACKENDS:
        raise PublishError(f"{where} names backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return str(backend)


def recorded_backend(model_dir: Path) -> str | None:
    """The backend the model's versions are served with, or None for a model never published."""
    path = model_dir / BACKEND_FILE
    return parse_backend_file(path.read_text(), str(path)) if path.is_file() else None


def backend_file_text(backend: str) -> str:
    return json.dumps({"backend": backend}, indent=2) + "\n"


def check_backend_change(
    model_dir: Path,
    gpu_config_text: str,
    published: list[int],
    allow_change: bool,
    served: list[int],
) -> str:
    """`check_backend_change_of` for a model folder on disk."""
    return check_backend_change_of(
        model_dir.name,
        recorded_backend(model_dir),
        gpu_config_text,
        published,
        allow_change,
        lambda version, filename: (model_dir / str(version) / filename).is_file(),
        served,
    )


def check_backend_change_of(
    name: str,
    old: str | None,
    gpu_config_text: str,
    published: list[int],
    allow_change: bool,
    has_file: Callable[[int, str], bool],
    served: list[int] = (),  # type: ignore[assignment]
) -> str:
    """The new config's backend, after refusing a change that was not asked for or cannot load.

    `published` are the model's complete versions before this publish; those its desired state
    serves stay live under the new config (publishing never changes what is served), so they must
    hold the new backend's files.
    """
    cfg = parse(gpu_config_text)
    new = backend_of(cfg)
    if old is None or old == new:
        return new
    if not allow_change:
        raise PublishError(
            f"{name} is served with the {old} backend ({BACKEND_FILE}); this export would switch "
            f"it to {new} for every version. Export with the model's backend (e.g. --tensorrt off for "
            f"onnxruntime), publish under a new --name, or pass --change-backend"
        )
    live = [v for v in served if v in published]
    need = required_files(cfg)
    missing = {v: sorted(f for f in need if not has_file(v, f)) for v in live}
    missing = {v: files for v, files in missing.items() if files}
    if missing:
        detail = "; ".join(f"version {v} has no {', '.join(files)}" for v, files in missing.items())
        raise PublishError(
            f"cannot switch {name} from {old} to {new}: versions {sorted(missing)} stay live "
            f"(the model's desired state serves them) and still need {old} ({detail}). Publish under a "
            "new --name"
        )
    return new
