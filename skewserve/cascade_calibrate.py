"""`skewserve cascade calibrate`: the deferral rule of a two-stage cascade, chosen on validation data.

Both artifacts are run on the validation split of a data directory. The edge model's probabilities
are calibrated with one temperature, fitted by minimising the negative log-likelihood (Guo et al.
2017, "On Calibration of Modern Neural Networks", section 4.2). Then thresholds on the calibrated
probability of the predicted class are chosen for a target:

- `within=X`: the cascade's balanced accuracy at least the cloud model's minus X, with as few
  requests escalated as the search finds;
- `escalation=B`: at most a share B of requests escalated, with the best balanced accuracy found.

A per-class rule has one threshold per predicted class, chosen greedily: items are kept at the edge
class by class, most confident first, always taking next the group of items that costs the least
balanced accuracy per item kept (a knapsack by ratio). Balanced accuracy weighs every class alike,
so an error on a rare class costs far more than one on a head class, and rare classes end up with
higher thresholds: they escalate more. A global rule (one threshold, the baseline) is computed for
the same target either way, and both sets of figures go into the rule file.

The rule file's format and the rule itself (how a threshold is applied) are the gateway's
(gateway/fleet/cascade_rule.py): the validation figures are computed by that same code.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.fleet.cascade_rule import (
    DeferralRule,
    RuleError,
    calibrated,
    read_rule,
    rule_document,
    write_rule,
)
from skewserve.errors import SkewserveError

NEVER = 2.0  # a threshold no calibrated probability reaches: that class always escalates
TARGETS = ("within", "escalation")


class CalibrationError(SkewserveError):
    """Calibration cannot produce a rule; the message says what is missing and what to do."""


@dataclass(frozen=True)
class Target:
    kind: str  # "within" | "escalation"
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        kind, sep, value = text.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or kind not in TARGETS or not (0 <= number <= 1):
            raise CalibrationError(
                f"--target {text!r} is not a target: give within=X (the cloud model's balanced accuracy "
                "within X, e.g. within=0.01) or escalation=B (at most a share B escalated, e.g. escalation=0.35)"
            )
        return cls(kind, number)


@dataclass(frozen=True)
class Outputs:
    """Both models' probabilities on the validation split, and its labels."""

    edge: np.ndarray[Any, Any]
    cloud: np.ndarray[Any, Any]
    labels: np.ndarray[Any, Any]
    classes: list[str]


def predict(
    artifact: Path, data_dir: Path, batch: int = 256
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], list[str]]:
    """The artifact's softmax probabilities on the validation split (what the served model outputs),
    the labels, and the classes; CalibrationError naming the classes the split lacks."""
    import torch

    from training.artifact import load_model
    from training.data_source import open_data
    from training.datasets import SplitDataset

    model, meta = load_model(artifact)
    prov, pre = meta.get("provenance", {}), meta.get("preprocessing", {})
    size = pre.get("size")
    data = open_data(
        data_dir,
        prov.get("label_column", "label"),
        image_size=None if size is None else int(size[0]),
        channels=pre.get("channels"),
        augment=False,
        val_fraction=prov.get("val_fraction"),
        seed=int(prov.get("seed", 0)),
    )
    classes = list(meta["classes"])
    if data.classes != classes:
        raise CalibrationError(
            f"{data_dir} has classes {data.classes}, but {artifact} was trained on {classes}; "
            "calibrate on the data the models were trained for"
        )
    labels = np.asarray(data.val.labels, dtype=np.int64)
    counts = np.bincount(labels, minlength=len(classes))
    missing = [classes[i] for i in np.flatnonzero(counts == 0)]
    if missing:
        raise CalibrationError(
            f"the validation split of {data_dir} has no items of classes {missing} "
            f"({len(missing)} of {len(classes)}): a threshold for a class, and its recall, need items of "
            "that class; make a validation split holding every class (a larger val.csv, or more "
            "items per class in val/)"
        )
    split = SplitDataset(data.val, data.spec)
    out = []
    with torch.no_grad():
        for start in range(0, len(split), batch):
            inputs, _ = split.__getitems__(list(range(start, min(start + batch, len(split)))))
            out.append(torch.softmax(model(*inputs).float(), dim=1).numpy())
    return np.concatenate(out).astype(np.float64), labels, classes


def load_outputs(edge: Path, cloud: Path, data_dir: Path) -> Outputs:
    edge_p, labels, classes = predict(edge, data_dir)
    cloud_p, cloud_labels, cloud_classes = predict(cloud, data_dir)
    if cloud_classes != classes:
        raise CalibrationError(
            f"the edge model's classes {classes} differ from the cloud model's {cloud_classes}; "
            "a cascade needs two models of the same classes"
        )
    assert np.array_equal(labels, cloud_labels)
    return Outputs(edge_p, cloud_p, labels, classes)


# -- temperature --------------------------------------------------------------------------------------
def nll(probabilities: np.ndarray[Any, Any], labels: np.ndarray[Any, Any], temperature: float) -> float:
    p = calibrated(probabilities, temperature)[np.arange(len(labels)), labels]
    return float(-np.log(np.maximum(p, 1e-300)).mean())


def fit_temperature(probabilities: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> float:
    """The T minimising NLL: golden-section search on log T over [1/20, 20] (NLL is unimodal in T)."""
    lo, hi = math.log(0.05), math.log(20.0)
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = nll(probabilities, labels, math.exp(a)), nll(probabilities, labels, math.exp(b))
    for _ in range(60):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = nll(probabilities, labels, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = nll(probabilities, labels, math.exp(b))
    return round(math.exp((lo + hi) / 2), 6)


def ece(
    probabilities: np.ndarray[Any, Any], labels: np.ndarray[Any, Any], temperature: float, bins: int = 15
) -> float:
    """Expected calibration error of the top class (Guo et al. 2017, eq. 3), `bins` equal-width bins."""
    cal = calibrated(probabilities, temperature)
    conf, correct = cal.max(axis=1), cal.argmax(axis=1) == labels
    edges = np.linspace(0, 1, bins + 1)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            total += inside.mean() * abs(correct[inside].mean() - conf[inside].mean())
    return float(total)


# -- thresholds ---------------------------------------------------------------------------------------
def _gains(out: Outputs) -> tuple[np.ndarray[Any, Any], float]:
    """Each item's change of balanced accuracy when kept at the edge rather than escalated, and the
    balanced accuracy with everything escalated (the cloud's)."""
    n_classes = len(out.classes)
    per_class = np.bincount(out.labels, minlength=n_classes).astype(np.float64)
    weight = 1.0 / (per_class[out.labels] * n_classes)
    edge_ok = out.edge.argmax(axis=1) == out.labels
    cloud_ok = out.cloud.argmax(axis=1) == out.labels
    return (edge_ok.astype(np.float64) - cloud_ok) * weight, float((cloud_ok * weight).sum())


def _groups(scores: np.ndarray[Any, Any], items: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    """`items` in groups of equal score, highest score first."""
    ordered = items[np.argsort(-scores[items], kind="stable")]
    if len(ordered) == 0:
        return []
    cuts = np.flatnonzero(np.diff(scores[ordered]) != 0) + 1
    return np.split(ordered, cuts)


def per_class_thresholds(out: Outputs, temperature: float, target: Target) -> list[float]:
    """Greedy by ratio: keep next, in whichever class, the run of groups (most confident first)
    that costs the least balanced accuracy per item kept, while the target allows it. Looking at
    runs rather than single groups lets one wrong item be taken with the many right ones behind it."""
    n = len(out.labels)
    gains, bacc = _gains(out)
    predicted = out.edge.argmax(axis=1)
    scores = calibrated(out.edge, temperature)[np.arange(n), predicted]
    runs: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
    for k in range(len(out.classes)):
        groups = _groups(scores, np.flatnonzero(predicted == k))
        if groups:  # classes the edge never predicts keep NEVER
            runs[k] = (
                np.array([gains[g].sum() for g in groups]),
                np.array([len(g) for g in groups], dtype=np.float64),
                np.array([scores[g[0]] for g in groups]),
            )
    at = dict.fromkeys(runs, 0)  # groups kept so far, per class
    thresholds = [NEVER] * len(out.classes)
    kept = 0.0
    required = _required(out, target)
    while True:
        best: tuple[float, int, int, float, float] | None = None
        for k in list(at):
            group_gains, sizes, _ = runs[k]
            gained, taken = np.cumsum(group_gains[at[k] :]), np.cumsum(sizes[at[k] :])
            if target.kind == "within":
                fits = bacc + gained >= required - 1e-12
            elif (n - kept) / n > target.value:
                # over the budget: keep more, whatever it costs, but no run past the one that meets it
                need = (n - kept) - math.floor(target.value * n + 1e-9)
                fits = taken - sizes[at[k] :] < need
            else:
                fits = gained >= 0
            if not fits.any():
                del at[k]  # nothing more of this class fits: it stays where it is
                continue
            ratio = np.where(fits, gained / taken, -np.inf)
            j = len(ratio) - 1 - int(ratio[::-1].argmax())  # the longest run among equal ratios
            if best is None or ratio[j] > best[0]:
                best = (float(ratio[j]), k, j, float(gained[j]), float(taken[j]))
        if best is None:
            break
        _, k, j, gained_k, taken_k = best
        at[k] += j + 1
        bacc += gained_k
        kept += taken_k
        thresholds[k] = float(runs[k][2][at[k] - 1])
        if at[k] == len(runs[k][0]):
            del at[k]
    return thresholds


def global_threshold(out: Outputs, temperature: float, target: Target) -> float:
    """One threshold for all classes: the lowest that meets `within`, or under `escalation` the one
    with the best balanced accuracy among those that escalate few enough."""
    n = len(out.labels)
    gains, bacc = _gains(out)
    predicted = out.edge.argmax(axis=1)
    scores = calibrated(out.edge, temperature)[np.arange(n), predicted]
    required = _required(out, target)
    best, best_bacc, kept = NEVER, -math.inf, 0
    if target.kind == "within" or target.value >= 1:
        best_bacc = bacc  # keeping nothing: the cloud's own figure
    for group in _groups(scores, np.arange(n)):
        bacc += float(gains[group].sum())
        kept += len(group)
        t = float(scores[group[0]])
        if target.kind == "within":
            if bacc >= required - 1e-12:
                best = t
        elif (n - kept) / n <= target.value and bacc >= best_bacc - 1e-12:
            best, best_bacc = t, bacc
    return best


def _required(out: Outputs, target: Target) -> float:
    return _gains(out)[1] - target.value if target.kind == "within" else -math.inf


# -- figures ------------------------------------------------------------------------------------------
def _recalls(
    predicted: np.ndarray[Any, Any], labels: np.ndarray[Any, Any], n_classes: int
) -> np.ndarray[Any, Any]:
    support = np.bincount(labels, minlength=n_classes)
    hits = np.bincount(labels[predicted == labels], minlength=n_classes)
    recalls: np.ndarray[Any, Any] = hits / np.maximum(support, 1)
    return recalls


def figures(out: Outputs, rule: DeferralRule) -> dict[str, Any]:
    """The cascade's figures on the validation split, the rule applied as the gateway applies it."""
    n_classes = len(out.classes)
    keep = rule.keeps(out.edge)
    answer = np.where(keep, out.edge.argmax(axis=1), out.cloud.argmax(axis=1))
    recalls = _recalls(answer, out.labels, n_classes)
    escalated = np.bincount(out.labels[~keep], minlength=n_classes) / np.bincount(
        out.labels, minlength=n_classes
    )
    return {
        "balanced_accuracy": round(float(recalls.mean()), 6),
        "worst_class_recall": round(float(recalls.min()), 6),
        "escalation_rate": round(float((~keep).mean()), 6),
        "per_class": {
            name: {
                "threshold": round(rule.thresholds[i], 6),
                "recall": round(float(recalls[i]), 6),
                "escalation_rate": round(float(escalated[i]), 6),
            }
            for i, name in enumerate(out.classes)
        },
    }


def _model_figures(probabilities: np.ndarray[Any, Any], out: Outputs) -> dict[str, float]:
    recalls = _recalls(probabilities.argmax(axis=1), out.labels, len(out.classes))
    return {
        "balanced_accuracy": round(float(recalls.mean()), 6),
        "worst_class_recall": round(float(recalls.min()), 6),
    }


def _artifact(path: Path) -> dict[str, Any]:
    weights = Path(path) / "model.pt"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
    return {"artifact": str(path), "weights_sha256": digest}


def calibrate(
    edge: Path, cloud: Path, data_dir: Path, target: Target, kind: str, out_path: Path
) -> dict[str, Any]:
    """Fit, choose, and write the rule file (its version one above the file it replaces, when the
    decision changed); returns the document written."""
    if kind not in ("per_class", "global"):
        raise CalibrationError(f"--rule {kind!r} is not a rule kind: give per-class or global")
    out = load_outputs(edge, cloud, data_dir)
    temperature = fit_temperature(out.edge, out.labels)
    rules = {}
    for k in ("per_class", "global"):
        thresholds = (
            per_class_thresholds(out, temperature, target)
            if k == "per_class"
            else [global_threshold(out, temperature, target)] * len(out.classes)
        )
        doc = rule_document(k, out.classes, temperature, thresholds, 0)
        rules[k] = DeferralRule(
            k, doc["output"], tuple(out.classes), temperature, tuple(thresholds), 0, doc["digest"]
        )
    chosen, baseline = rules[kind], rules["global" if kind == "per_class" else "per_class"]
    version = 1
    if out_path.is_file():
        try:
            previous = read_rule(out_path)
        except RuleError:
            previous = None  # replaced whole: a file that cannot be applied has no version to follow
        if previous is not None:
            version = previous.version + (0 if previous.digest == chosen.digest else 1)
    document = rule_document(
        kind,
        out.classes,
        temperature,
        list(chosen.thresholds),
        version,
        target={"kind": target.kind, "value": target.value},
        validation={
            "data": str(data_dir),
            "split": "val",
            "items": int(len(out.labels)),
            "class_counts": dict(
                zip(out.classes, np.bincount(out.labels, minlength=len(out.classes)).tolist(), strict=True)
            ),
            "temperature": {
                "nll_before": round(nll(out.edge, out.labels, 1.0), 6),
                "nll_after": round(nll(out.edge, out.labels, temperature), 6),
                "ece_before": round(ece(out.edge, out.labels, 1.0), 6),
                "ece_after": round(ece(out.edge, out.labels, temperature), 6),
            },
            "edge": _model_figures(out.edge, out),
            "cloud": _model_figures(out.cloud, out),
            "cascade": figures(out, chosen),
            f"baseline_{baseline.kind}": figures(out, baseline),
        },
        models={"edge": _artifact(edge), "cloud": _artifact(cloud)},
    )
    write_rule(out_path, document)
    return json.loads(json.dumps(document))
