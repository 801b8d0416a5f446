"""A cascade's deferral rule: when the first stage's answer is good enough to keep.

The rule reads the first stage's class probabilities, calibrates them with one temperature
(Guo et al. 2017, "On Calibration of Modern Neural Networks": softmax(z / T); the served models
output softmax probabilities, and log p differs from the logits z only by a constant per row, so
softmax(log p / T) is the same calibrated distribution), and keeps the answer when the calibrated
probability of the predicted class reaches that class's threshold. A per-class rule gives rare
classes, on which a small model is confidently wrong, higher thresholds than head classes; a global
rule is one threshold for all, the baseline.

The rule file is the contract between `skewserve cascade calibrate`, which writes it, and the
gateway, which reads it: one JSON document (`FORMAT`) holding the decision fields, their digest,
a version number and the validation figures they were chosen on. A file whose digest does not
match its decision fields is refused (a hand edit, a half-written copy), so the digest the gateway
puts in its cache keys always names the rule it applies.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import ConfigError

FORMAT = "skewserve.cascade-rule/1"
KINDS = ("per_class", "global")
NEVER_KEEP = 2.0  # a threshold no calibrated probability reaches: that class always escalates


class RuleError(ConfigError):
    """A rule file that cannot be applied; the message names the file and the field."""


def decision_digest(
    kind: str, output: str, classes: list[str], temperature: float, thresholds: list[float]
) -> str:
    """sha256 of the fields that decide an answer, in one canonical JSON form."""
    fields = {
        "kind": kind,
        "output": output,
        "classes": list(classes),
        "temperature": float(temperature),
        "thresholds": [float(t) for t in thresholds],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def calibrated(probabilities: np.ndarray[Any, Any], temperature: float) -> np.ndarray[Any, Any]:
    """softmax(log p / T), row by row, in float64 (p = 0 stays 0)."""
    logp = np.log(np.maximum(np.asarray(probabilities, dtype=np.float64), 1e-300)) / temperature
    logp -= logp.max(axis=1, keepdims=True)
    e = np.exp(logp)
    out: np.ndarray[Any, Any] = e / e.sum(axis=1, keepdims=True)
    return out


@dataclass(frozen=True)
class Verdict:
    """What the rule said about one answer: kept (every row passed) and the deciding row's score."""

    keep: bool
    score: float  # the calibrated probability of the row closest to (or furthest below) its threshold
    classes: tuple[int, ...]  # the predicted class of each row
    scores: tuple[float, ...]  # each row's calibrated probability of its predicted class


@dataclass(frozen=True)
class DeferralRule:
    kind: str
    output: str
    classes: tuple[str, ...]
    temperature: float
    thresholds: tuple[float, ...]  # per class; a global rule repeats one value
    version: int
    digest: str
    path: str = ""

    @property
    def tag(self) -> str:
        """Version and digest, as answers and cache keys name the rule."""
        return f"{self.version}-{self.digest[:16]}"

    def judge(self, probabilities: np.ndarray[Any, Any]) -> Verdict | None:
        """The verdict on one answer's probabilities (one row per item); None when they do not have
        one column per class of the rule (the answer cannot be judged: the caller escalates)."""
        p = np.asarray(probabilities)
        if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] != len(self.classes):
            return None
        cal = calibrated(p, self.temperature)
        predicted = p.argmax(axis=1)
        scores = cal[np.arange(len(p)), predicted]
        margins = scores - np.asarray(self.thresholds)[predicted]
        worst = int(margins.argmin())
        return Verdict(
            keep=bool((margins >= 0).all()),
            score=float(scores[worst]),
            classes=tuple(int(c) for c in predicted),
            scores=tuple(float(s) for s in scores),
        )

    def keeps(self, probabilities: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Item by item (each row its own request): whether the rule keeps the first stage's answer."""
        cal = calibrated(probabilities, self.temperature)
        predicted = np.asarray(probabilities).argmax(axis=1)
        kept: np.ndarray[Any, Any] = (
            cal[np.arange(len(cal)), predicted] >= np.asarray(self.thresholds)[predicted]
        )
        return kept


def rule_document(
    kind: str,
    classes: list[str],
    temperature: float,
    thresholds: list[float],
    version: int,
    output: str = "probabilities",
    **extra: Any,
) -> dict[str, Any]:
    """A complete rule file's content (`extra`: the target, validation figures, models)."""
    return {
        "format": FORMAT,
        "version": version,
        "digest": decision_digest(kind, output, classes, temperature, thresholds),
        "kind": kind,
        "output": output,
        "classes": list(classes),
        "temperature": float(temperature),
        "thresholds": [float(t) for t in thresholds],
        **extra,
    }


def write_rule(path: Path, document: dict[str, Any]) -> Path:
    """Write the rule aside and rename it into place: a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_rule(path: str | Path) -> DeferralRule:
    """The rule in `path`, checked whole; RuleError naming the file and the field otherwise."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise RuleError(f"cascade rule {where} cannot be read: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise RuleError(f"cascade rule {where} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise RuleError(
            f"cascade rule {where}: format must be {FORMAT!r}, got {got!r}; write it with `skewserve cascade calibrate`"
        )
    try:
        kind, output = str(doc["kind"]), str(doc["output"])
        classes = [str(c) for c in doc["classes"]]
        temperature = float(doc["temperature"])
        thresholds = [float(t) for t in doc["thresholds"]]
        version, digest = int(doc["version"]), str(doc["digest"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RuleError(f"cascade rule {where}: missing or malformed field {exc}") from exc
    if kind not in KINDS:
        raise RuleError(f"cascade rule {where}: kind must be one of {list(KINDS)}, got {kind!r}")
    if not classes or len(thresholds) != len(classes):
        raise RuleError(
            f"cascade rule {where}: {len(thresholds)} thresholds for {len(classes)} classes; "
            "give one threshold per class"
        )
    if not (math.isfinite(temperature) and temperature > 0):
        raise RuleError(f"cascade rule {where}: temperature must be a positive number, got {temperature}")
    if not all(math.isfinite(t) for t in thresholds):
        raise RuleError(f"cascade rule {where}: thresholds must be finite numbers, got {thresholds}")
    expected = decision_digest(kind, output, classes, temperature, thresholds)
    if digest != expected:
        raise RuleError(
            f"cascade rule {where}: digest {digest[:16]}... does not match its decision fields "
            f"({expected[:16]}...): the file was edited or cut short; write rules with "
            "`skewserve cascade calibrate` (or gateway.fleet.cascade_rule.rule_document)"
        )
    return DeferralRule(kind, output, tuple(classes), temperature, tuple(thresholds), version, digest, where)
