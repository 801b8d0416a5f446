"""What a model repository holds and how its names are read, on disk and in object storage.

<repo>/<model>/config.pbtxt               the GPU profile (version policy names the served versions)
<repo>/<model>/configs/local.pbtxt        the CPU profile
<repo>/<model>/labels.txt                 class names
<repo>/<model>/serving_backend.json       the backend the model's versions run on (backend.py)
<repo>/<model>/desired_state.json         the desired-state record (desired_state.py)
<repo>/<model>/<v>/model_card.json        written last: a version is complete when it has one
<repo>/<model>/<v>/.skewserve-configs/    the model-level files <v> was published with
<repo>/<model>/.tmp-*                     staging folders (Triton ignores non-integer folders)
<repo>/.skewserve-<name>.json             repository-level records (e.g. the controller's lease)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from repository.model_config import LOCAL_PROFILE

STAGING_PREFIX = ".tmp-"
# Model-level files are written as `.<name>.tmp-<hex>` beside their target, then renamed.
MODEL_FILE_TMP = ".tmp-"
CARD = "model_card.json"
# Inside each version folder: the model-level files (configs, labels) it was published with. Triton
# reads only the model files a backend names there, so the folder is invisible to it.
VERSION_CONFIGS = ".skewserve-configs"
# The model-level files a publish writes, config.pbtxt last: Triton reads it to find the others.
MODEL_FILE_ORDER = ("labels.txt", f"configs/{LOCAL_PROFILE}.pbtxt", "config.pbtxt")


@dataclass(frozen=True)
class Published:
    name: str
    version: int
    path: Path


def record_file(name: str) -> str:
    """A repository-level record's file: at the root, beside no model, so Triton never reads it as one."""
    return f".skewserve-{name}.json"
