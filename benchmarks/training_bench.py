"""Training benchmark: quality of skew-balanced losses/samplers, and rank-speed balancing.

Prints two tables from one run:
1. test balanced accuracy / macro-F1 on `skewserve data synth` (10 classes, imbalance ratio 100)
   for plain CE, each skew-balanced loss/sampler, and scikit-learn's
   LogisticRegression(class_weight="balanced") as an outside reference;
2. two torchrun ranks with rank 1 slowed 2x: epoch wall time and imbalance ratio with rank-speed
   balancing off and on.
Usage: python benchmarks/training_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.config import TrainConfig  # noqa: E402
from training.data import load_data_dir  # noqa: E402
from training.launch import train  # noqa: E402
from training.metrics import classification_report  # noqa: E402
from training.synth import SynthSpec, write  # noqa: E402

QUALITY_RUNS = [
    ("ce (plain)", {"loss": "ce", "sampler_q": 1.0}),
    ("weighted_ce (inverse freq)", {"loss": "weighted_ce"}),
    ("effective_ce (Cui 2019)", {"loss": "effective_ce"}),
    ("focal (gamma 2)", {"loss": "focal"}),
    ("logit_adjusted (tau 1)", {"loss": "logit_adjusted"}),
    ("balanced_softmax", {"loss": "balanced_softmax"}),
    ("ce + class-uniform sampler (q 0)", {"loss": "ce", "sampler_q": 0.0}),
    ("ce + sqrt sampler (q 0.5)", {"loss": "ce", "sampler_q": 0.5}),
]


def sklearn_reference(data_dir: Path) -> dict[str, float]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    d = load_data_dir(data_dir)
    clf = make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=2000))
    clf.fit(d.train.features, d.train.labels)
    assert d.test is not None
    return classification_report(d.test.labels, clf.predict(d.test.features), d.classes)


def quality(work: Path, epochs: int, seeds: list[int]) -> None:
    print(
        f"\n## Quality: 10 classes, imbalance ratio 100, test split class-balanced; mean over seeds {seeds}\n"
    )
    print(f"| {'method':34s} | bal. acc | macro-F1 | tail-3 recall |")
    print(f"|{'-' * 36}|---------:|---------:|--------------:|")
    rows = []
    for seed in seeds:
        data = work / f"data-{seed}"
        write(SynthSpec(n_classes=10, imbalance_ratio=100, seed=seed), data)
    for name, overrides in QUALITY_RUNS:
        b, f, tail = [], [], []
        for seed in seeds:
            out = work / f"q-{name.split()[0]}-{overrides.get('sampler_q', 1)}-{seed}"
            cfg = TrainConfig(
                data_dir=work / f"data-{seed}",
                out_dir=out,
                epochs=epochs,
                seed=seed,
                progress=False,
                **overrides,
            )
            train(cfg)
            m = json.loads((out / "metrics.json").read_text())["test"]
            b.append(m["balanced_accuracy"])
            f.append(m["macro_f1"])
            tail.append(np.mean([c["recall"] for c in list(m["per_class"].values())[-3:]]))
        rows.append((name, np.mean(b), np.mean(f), np.mean(tail)))
        print(f"| {name:34s} | {np.mean(b):8.4f} | {np.mean(f):8.4f} | {np.mean(tail):13.4f} |", flush=True)
    refs = [sklearn_reference(work / f"data-{s}") for s in seeds]
    rb = np.mean([r["balanced_accuracy"] for r in refs])
    rf = np.mean([r["macro_f1"] for r in refs])
    rt = np.mean([np.mean([c["recall"] for c in list(r["per_class"].values())[-3:]]) for r in refs])
    print(f"| {'sklearn LogisticRegression balanced':34s} | {rb:8.4f} | {rf:8.4f} | {rt:13.4f} |")
    default = TrainConfig.model_fields["loss"].default
    ce = rows[0][1]
    dflt = next(r for r in rows if r[0].startswith(default))[1]
    print(
        f"\ndefault loss `{default}`: {100 * (dflt - ce):+.1f} points of balanced accuracy over plain CE, "
        f"{100 * (dflt - rb):+.1f} over the scikit-learn reference"
    )


def balance(work: Path, epochs: int) -> None:
    print("\n## Rank-speed balancing: 2 torchrun ranks (gloo), rank 1 slowed 2x\n")
    data = work / "data-balance"
    write(SynthSpec(n_classes=10, imbalance_ratio=100, n_max=4000, seed=0), data)
    print("| speed balancing | epoch wall (ms) | imbalance ratio max/mean busy | rank shares |")
    print("|-----------------|----------------:|------------------------------:|-------------|")
    walls = {}
    for on in (False, True):
        out = work / f"balance-{on}"
        cfg = TrainConfig(
            data_dir=data,
            out_dir=out,
            epochs=epochs,
            nproc=2,
            slow_rank=1,
            slow_factor=2.0,
            speed_balance=on,
            width=512,
            depth=3,
            global_batch_size=2048,
            patience=None,
            progress=False,
        )
        train(cfg, log_path=work / f"balance-{on}.log")
        epochs_log = [
            json.loads(line)
            for line in (out / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()
        ]
        steady = epochs_log[1:] or epochs_log  # epoch 0 includes the balancer's first measurements
        wall = float(np.mean([e["wall_s"] for e in steady]))
        ratio = float(np.mean([e["imbalance_ratio"] for e in steady]))
        walls[on] = wall
        print(
            f"| {'on' if on else 'off':15s} | {wall * 1000:15.1f} | {ratio:29.3f} | {steady[-1]['rank_shares']} |",
            flush=True,
        )
    print(f"\nspeed-up with balancing: {walls[False] / walls[True]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one seed, fewer epochs")
    parser.add_argument("--only", choices=["quality", "balance"], help="run one part")
    args = parser.parse_args()
    import os
    import platform

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only != "balance":
            quality(work, epochs=15 if args.quick else 40, seeds=[0] if args.quick else [0, 1, 2])
        if args.only != "quality":
            balance(work, epochs=3 if args.quick else 6)


if __name__ == "__main__":
    main()
