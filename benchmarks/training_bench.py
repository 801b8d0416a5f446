"""Training benchmark: quality of skew-balanced losses/samplers, and rank-speed balancing.

Prints three tables from one run:
0. defaults against the reference: `TrainConfig()` defaults, unchanged, against scikit-learn's
   LogisticRegression(class_weight="balanced") on the synthetic set and on long-tailed versions of
   the data sets that ship inside scikit-learn (digits, breast cancer, wine, iris: no download);
   each real set's training split is subsampled to an exponential long tail, the test split is
   class-balanced, the validation split follows the training distribution (as a real one would);
1. test balanced accuracy / macro-F1 on `skewserve data synth` (10 classes, imbalance ratio 100)
   for plain CE, each skew-balanced loss/sampler, and scikit-learn's
   LogisticRegression(class_weight="balanced") as an outside reference;
2. two torchrun ranks with rank 1 slowed 2x: epoch wall time and imbalance ratio with rank-speed
   balancing off and on.
3. built-in families: `cnn` and `mlp` defaults on scikit-learn's digits as long-tailed 8x8 image
   folders (ratio 50, balanced test split), `text` on the generated topics set, each against
   class-weighted logistic regression on the same split; the cnn's data wait share per step.
4. streaming: peak resident memory of a cnn run on tensor shards of N and 4N images.
Usage: python benchmarks/training_bench.py [--quick] [--only defaults|quality|balance|families|streaming]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.config import TrainConfig  # noqa: E402
from training.data import load_data_dir  # noqa: E402
from training.launch import train  # noqa: E402
from training.metrics import classification_report  # noqa: E402
from training.synth import SynthSpec, write  # noqa: E402

# name -> (scikit-learn loader, test rows per class, imbalance ratio of the training split)
REAL_SETS = {
    "digits": ("load_digits", 40, 50.0),
    "breast_cancer": ("load_breast_cancer", 60, 50.0),
    "wine": ("load_wine", 10, 50.0),
    "iris": ("load_iris", 10, 50.0),
}
MIN_CLASS_ROWS = 3  # the rarest class keeps 2 training rows and 1 validation row


def write_real_long_tail(name: str, out: Path, seed: int, val_fraction: float = 0.2) -> dict[str, list[int]]:
    """A long-tailed train/val and a balanced test split of a scikit-learn bundled data set, as CSV.

    Class sizes decay exponentially from the smallest class's pool (after the test rows) down by
    the imbalance ratio, floored at MIN_CLASS_ROWS (Cui et al. 2019's long-tail construction); the
    seed picks which class is the head. Returns the per-split class counts.
    """
    import pandas as pd
    import sklearn.datasets

    loader, n_test, ratio = REAL_SETS[name]
    bunch = getattr(sklearn.datasets, loader)()
    x, y = np.asarray(bunch.data, dtype=np.float32), np.asarray(bunch.target)
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    pools = {c: rng.permutation(np.flatnonzero(y == c)) for c in classes}
    n_head = min(len(p) for p in pools.values()) - n_test
    sizes = {
        c: max(MIN_CLASS_ROWS, int(round(n_head * ratio ** (-i / (len(classes) - 1)))))
        for i, c in enumerate(rng.permutation(classes))
    }
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in classes:
        pool = pools[c]
        rest = pool[n_test : n_test + sizes[c]]
        n_val = max(1, int(round(val_fraction * len(rest))))
        parts["test"].append(pool[:n_test])
        parts["val"].append(rest[:n_val])
        parts["train"].append(rest[n_val:])
    out.mkdir(parents=True, exist_ok=True)
    columns = [f"x{j:02d}" for j in range(x.shape[1])]
    counts = {}
    for split, chunks in parts.items():
        idx = np.concatenate(chunks)
        df = pd.DataFrame(x[idx], columns=columns)
        df["label"] = [f"class_{int(v)}" for v in y[idx]]
        df.to_csv(out / f"{split}.csv", index=False)
        counts[split] = np.bincount(y[idx], minlength=len(classes)).tolist()
    return counts


def defaults(work: Path, seeds: list[int]) -> None:
    print(
        f"\n## Defaults vs class-weighted logistic regression: test balanced accuracy, mean over seeds {seeds}\n"
    )
    print(
        "| data set | train rows | classes | imbalance | val rows | default trainer | LR (balanced) | diff |"
    )
    print(
        "|----------|-----------:|--------:|----------:|---------:|----------------:|--------------:|-----:|"
    )
    sets: list[tuple[str, Any]] = [("synthetic (10 cl.)", None), *((n, n) for n in REAL_SETS)]
    wins = 0
    for label, real in sets:
        ours, ref, rows, imb, val_rows = [], [], [], [], []
        for seed in seeds:
            data = work / f"defaults-{label.split()[0]}-{seed}"
            if real is None:
                write(SynthSpec(n_classes=10, imbalance_ratio=100, seed=seed), data)
            else:
                write_real_long_tail(real, data, seed)
            d = load_data_dir(data)
            counts = d.class_counts
            rows.append(len(d.train))
            imb.append(counts.max() / counts.min())
            val_rows.append(len(d.val))
            # Only the benchmark's own choices: the seed, quiet output, one thread per run (tiny models
            # on a shared machine). Every training setting is the default.
            cfg = TrainConfig(
                data_dir=data,
                out_dir=work / f"out-{data.name}",
                seed=seed,
                progress=False,
                threads_per_rank=1,
            )
            ours.append(train(cfg)["metrics"]["test"]["balanced_accuracy"])
            ref.append(sklearn_reference(data)["balanced_accuracy"])
        o, r = float(np.mean(ours)), float(np.mean(ref))
        wins += o > r
        print(
            f"| {label} | {np.mean(rows):.0f} | {len(d.classes)} | {np.mean(imb):.0f} | {np.mean(val_rows):.0f} "
            f"| {o:.4f} | {r:.4f} | {100 * (o - r):+.1f} |",
            flush=True,
        )
    print(f"\ndefault trainer ahead on {wins} of {len(sets)} data sets")


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
    clf = make_pipeline(StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=5000))
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


def _bacc_reference(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, classes: list[str]
) -> float:
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(class_weight="balanced", max_iter=3000).fit(x_train, y_train)
    return float(classification_report(y_test, clf.predict(x_test), classes)["balanced_accuracy"])


def _split_arrays(ds: Any, split: str) -> tuple[np.ndarray, np.ndarray]:
    from training.datasets import SplitDataset

    part = getattr(ds, split)
    inputs, labels = SplitDataset(part, ds.spec).__getitems__(list(range(len(part))))
    return inputs[0].numpy(), labels.numpy()


def families(work: Path, seeds: list[int]) -> None:
    """Built-in families on real long-tailed images and on generated text, against class-weighted
    logistic regression on the same split (flattened pixels / bag of words), with default settings."""
    from training.data_source import open_data
    from training.datasets_builtin import write_digits_lt, write_topics_lt

    rows: dict[str, list[float]] = {}
    data_wait: list[float] = []
    for seed in seeds:
        d = work / f"digits-lt-{seed}"
        write_digits_lt(d, ratio=50.0, seed=seed)
        ds = open_data(d, augment=False)
        xtr, ytr = _split_arrays(ds, "train")
        xte, yte = _split_arrays(ds, "test")
        rows.setdefault("digits-LT: logistic regression (balanced), pixels", []).append(
            _bacc_reference(
                xtr.reshape(len(xtr), -1) / 255.0, ytr, xte.reshape(len(xte), -1) / 255.0, yte, ds.classes
            )
        )
        for model in ("cnn", "mlp"):
            out = work / f"digits-{model}-{seed}"
            meta = train(TrainConfig(data_dir=d, out_dir=out, model=model, seed=seed, progress=False))
            rows.setdefault(f"digits-LT: {model} (defaults)", []).append(
                meta["metrics"]["test"]["balanced_accuracy"]
            )
            if model == "cnn":
                epochs = [
                    json.loads(line)
                    for line in (out / "checkpoints" / "monitor-epochs.jsonl").read_text().splitlines()
                ]
                wait = sum(e["data_wait_s_per_step"][0] * e["steps"] for e in epochs)
                busy = sum(e["busy_s_per_step"][0] * e["steps"] for e in epochs)
                data_wait.append(wait / busy)
        t = work / f"topics-{seed}"
        write_topics_lt(t, seed=seed)
        tds = open_data(t)
        (ttr, ytr), (tte, yte) = _split_arrays(tds, "train"), _split_arrays(tds, "test")
        vocab = len(tds.spec.preprocessing["vocab"]) + 2

        def bag(tokens: np.ndarray, vocab: int = vocab) -> np.ndarray:
            out = np.zeros((len(tokens), vocab), dtype=np.float32)
            for i, row in enumerate(tokens):
                np.add.at(out[i], row[row > 0], 1.0)
            return out

        rows.setdefault("topics-LT: logistic regression (balanced), bag of words", []).append(
            _bacc_reference(bag(ttr), ytr, bag(tte), yte, tds.classes)
        )
        meta = train(
            TrainConfig(
                data_dir=t, out_dir=work / f"topics-text-{seed}", model="text", seed=seed, progress=False
            )
        )
        rows.setdefault("topics-LT: text (defaults)", []).append(meta["metrics"]["test"]["balanced_accuracy"])
    print(f"\nbuilt-in families, test balanced accuracy, {len(seeds)} seeds (mean ± std):")
    for name, values in rows.items():
        print(f"  {name:58s} {np.mean(values):.4f} ± {np.std(values):.4f}")
    print(
        f"  cnn data wait / busy time per step (image folders, default workers): {100 * np.mean(data_wait):.1f}%"
    )


def streaming(work: Path, base_items: int = 8000) -> None:
    """Peak memory of a run when the data set grows 4x: tensor shards of 3x64x64 uint8 images (12 KiB
    each), the cnn family, 40 steps, one DataLoader worker; each run in its own process."""
    import subprocess

    print("\nstreaming: peak resident memory of a training run vs data set size (tensor shards)")
    for n in (base_items, 4 * base_items):
        d = work / f"stream-{n}"
        rng = np.random.default_rng(0)
        for split, m in (("train", n), ("val", 256)):
            (d / split).mkdir(parents=True)
            labels = np.minimum(rng.geometric(0.3, m) - 1, 9)
            images = np.lib.format.open_memmap(
                d / split / "image.npy", mode="w+", dtype=np.uint8, shape=(m, 3, 64, 64)
            )
            for start in range(0, m, 1024):  # written in chunks: the writer holds no whole set either
                images[start : start + 1024] = rng.integers(
                    0, 256, (min(1024, m - start), 3, 64, 64), dtype=np.uint8
                )
            images.flush()
            del images
            np.save(d / split / "labels.npy", labels)
        size_mb = (d / "train" / "image.npy").stat().st_size / 2**20
        cmd = [
            sys.executable, "-c",
            "import resource, sys; from training.config import TrainConfig; from training.launch import train; "
            f"train(TrainConfig(data_dir={str(d)!r}, out_dir={str(d / 'art')!r}, model='cnn', "
            "model_args={'width': 8}, max_steps=40, global_batch_size=64, data_workers=1, progress=False)); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
        ]  # fmt: skip
        out = subprocess.run(
            cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], check=True
        )
        peak = int(out.stdout.split()[-1]) / 1024
        print(f"  {n:6d} items, {size_mb:6.0f} MiB on disk: peak RSS of the trainer {peak:6.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one seed, fewer epochs")
    parser.add_argument(
        "--only", choices=["defaults", "quality", "balance", "families", "streaming"], help="run one part"
    )
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds of the defaults table (3,4,5 were held out)"
    )
    parser.add_argument(
        "--family-seeds", default="0,1,2,3,4,5,6,7,8", help="comma-separated seeds of the families table"
    )
    args = parser.parse_args()
    import os
    import platform

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "defaults"):
            seeds = [int(x) for x in args.seeds.split(",")]
            defaults(work, seeds=seeds[:1] if args.quick else seeds)
        if args.only in (None, "quality"):
            quality(work, epochs=15 if args.quick else 40, seeds=[0] if args.quick else [0, 1, 2])
        if args.only in (None, "balance"):
            balance(work, epochs=3 if args.quick else 6)
        if args.only in (None, "streaming"):
            streaming(work, base_items=2000 if args.quick else 8000)
        if args.only in (None, "families"):
            n = [int(x) for x in args.family_seeds.split(",")]
            families(work, n[:1] if args.quick else n)


if __name__ == "__main__":
    main()
