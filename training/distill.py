"""Knowledge distillation from a trained artifact (the cloud model) into any student family.

The student minimises (Hinton et al., 2015, "Distilling the Knowledge in a Neural Network", sec. 2)

    (1 - w) * balanced_loss(student, y) + w * T^2 * KL(softmax(t / T) || softmax(s / T))

where `t` are the teacher's *balanced* logits: the student should learn the balanced decision, not
the head-biased one. A teacher trained with plain or focal cross-entropy estimates p(y|x) under the
skewed training prior; its balanced posterior is the post-hoc logit adjustment
`t = logits - tau * log(prior)` (Menon et al., ICLR 2021, eq. 9). A teacher trained with a
balancing loss (logit_adjusted, balanced_softmax, weighted or effective-number CE) already serves
balanced logits (eq. 10: the adjustment lives in its loss, its raw logits are used as-is), so it is
not adjusted twice. T^2 keeps the soft term's gradient scale independent of T (Hinton, sec. 2).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.artifact import WEIGHTS_NAME, load_model, read_metadata
from training.data_spec import DataSpec
from training.errors import ConfigError

# Losses whose raw logits are already the balanced posterior: the teacher is used as-is.
BALANCING_LOSSES = frozenset({"logit_adjusted", "balanced_softmax", "weighted_ce", "effective_ce"})
# Preprocessing entries that give the inputs their meaning (a column order, a pixel grid, token ids);
# statistics of the teacher's own training data (mean, std, max ids) may differ.
CONTRACT_KEYS = ("feature_names", "size", "channels", "vocab")


def artifact_digest(artifact: Path) -> str:
    """sha256 over the artifact's weights and metadata: which teacher, exactly."""
    digest = hashlib.sha256()
    for name in (WEIGHTS_NAME, "metadata.json"):
        digest.update((Path(artifact) / name).read_bytes())
    return digest.hexdigest()


def teacher_mismatches(teacher: dict[str, Any], data: DataSpec) -> list[str]:
    """How the teacher's contract (classes, inputs, their meaning) differs from the training data's."""
    problems = []
    if list(teacher["classes"]) != list(data.classes):
        problems.append(f"classes: teacher {list(teacher['classes'])} vs data {list(data.classes)}")
    if teacher.get("data_kind") != data.kind:
        problems.append(f"data kind: teacher {teacher.get('data_kind')!r} vs data {data.kind!r}")
    mine = [{k: i[k] for k in ("name", "dtype", "shape")} for i in teacher["inputs"]]
    theirs = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape)} for i in data.inputs]
    if mine != theirs:
        problems.append(f"inputs: teacher {mine} vs data {theirs}")
    pre = teacher.get("preprocessing", {})
    for key in CONTRACT_KEYS:
        if pre.get(key) != data.preprocessing.get(key):
            problems.append(
                f"preprocessing {key}: teacher {pre.get(key)!r} vs data {data.preprocessing.get(key)!r}"
            )
    return problems


def check_teacher(artifact: Path, data: DataSpec) -> dict[str, Any]:
    """The teacher's metadata, or a ConfigError naming every way it does not fit the data."""
    try:
        meta = read_metadata(artifact)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--distill-from {artifact}: {exc}") from exc
    problems = teacher_mismatches(meta, data)
    if problems:
        raise ConfigError(
            f"--distill-from {artifact}: the teacher does not fit this data ({'; '.join(problems)}); "
            "distil from a model trained on the same classes and inputs"
        )
    return meta


def posthoc_tau(meta: dict[str, Any], tau: float) -> float:
    """The adjustment strength for the teacher's logits: 0 when its loss already balanced them."""
    return 0.0 if meta.get("provenance", {}).get("loss", "ce") in BALANCING_LOSSES else tau


class Teacher(nn.Module):
    """The frozen teacher (eval mode, no gradients) returning balanced logits."""

    logit_offset: torch.Tensor

    def __init__(self, artifact: Path, data: DataSpec, tau: float) -> None:
        super().__init__()
        meta = check_teacher(artifact, data)
        model, _ = load_model(artifact)
        self.model = model.eval().requires_grad_(False)
        self.tau = posthoc_tau(meta, tau)
        prior = np.asarray(meta["class_priors"], dtype=np.float64)
        self.register_buffer(
            "logit_offset", torch.tensor(self.tau * np.log(np.maximum(prior, 1e-12)), dtype=torch.float32)
        )
        self.record = {
            "path": str(Path(artifact).resolve()),
            "sha256": artifact_digest(artifact),
            "model": meta["model"].get("name"),
            "loss": meta.get("provenance", {}).get("loss"),
            "adjustment_tau": self.tau,
            "metrics": meta.get("metrics", {}),
        }

    def train(self, mode: bool = True) -> Teacher:
        return super().train(False)  # always eval: no dropout, no input noise, frozen batch norm

    @torch.no_grad()
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs).float() - self.logit_offset


class DistillationLoss(nn.Module):
    """Per-sample (1 - w) * balanced loss + w * T^2 * KL(teacher || student) at temperature T."""

    def __init__(self, balanced: nn.Module, teacher: Teacher, weight: float, temperature: float) -> None:
        super().__init__()
        self.balanced = balanced
        self.teacher = teacher
        self.weight = weight
        self.temperature = temperature

    def forward(
        self, logits: torch.Tensor, target: torch.Tensor, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        hard = self.balanced(logits, target)
        t = self.temperature
        soft_teacher = F.log_softmax(self.teacher(*inputs) / t, dim=1)
        soft_student = F.log_softmax(logits.float() / t, dim=1)
        kl = (soft_teacher.exp() * (soft_teacher - soft_student)).sum(dim=1)
        return (1.0 - self.weight) * hard + self.weight * t * t * kl
