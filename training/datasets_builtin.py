"""Small real and generated data sets the project ships, in the layouts users bring their own in.

- `write_digits_lt`: scikit-learn's handwritten digits (1,797 8x8 grey images, shipped inside the
  package, no download) as image folders, made long-tailed the way CIFAR-LT is (Cui et al. 2019:
  training class sizes decay exponentially, largest/smallest = `ratio`) with class-balanced
  validation and test splits.
- `write_topics_lt`: generated text as tensor shards (token ids with lengths, vocab.txt,
  classes.txt). Real text sets (20 Newsgroups, AG News) download at run time, which this project
  cannot; this one is made of words, tokenized by `training.text_preprocess` like served text is,
  so the raw-text ensemble can be tested end to end. Each class draws some words from its own
  topic vocabulary and the rest from a Zipf-distributed common vocabulary, with lengths 4-48.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from training.text_preprocess import tokenize, vocabulary


def long_tail_sizes(n_classes: int, n_max: int, ratio: float) -> list[int]:
    return [max(1, int(round(n_max * ratio ** (-c / max(1, n_classes - 1))))) for c in range(n_classes)]


def write_digits_lt(
    out: Path, ratio: float = 50.0, val_per_class: int = 30, test_per_class: int = 40, seed: int = 0
) -> dict[str, list[int]]:
    """Digits as PNG folders: train/ long-tailed, val/ and test/ balanced. Returns per-split class counts."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    pixels = np.clip(digits.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    order = rng.permutation(10)  # which digit is rare depends on the seed, not on its value
    per_class = [rng.permutation(np.flatnonzero(digits.target == c)) for c in range(10)]
    n_train_max = min(len(p) for p in per_class) - val_per_class - test_per_class
    sizes = long_tail_sizes(10, n_train_max, ratio)
    counts: dict[str, list[int]] = {"train": [0] * 10, "val": [0] * 10, "test": [0] * 10}
    for rank, c in enumerate(order):
        idx = per_class[c]
        parts = {
            "val": idx[:val_per_class],
            "test": idx[val_per_class : val_per_class + test_per_class],
            "train": idx[val_per_class + test_per_class :][: sizes[rank]],
        }
        for split, members in parts.items():
            folder = out / split / f"digit_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in members:
                Image.fromarray(pixels[i], mode="L").save(folder / f"{i:04d}.png")
            counts[split][c] = len(members)
    return counts


def write_topics_lt(
    out: Path,
    n_classes: int = 6,
    ratio: float = 20.0,
    n_max: int = 600,
    val_per_class: int = 40,
    test_per_class: int = 60,
    max_length: int = 48,
    seed: int = 0,
) -> dict[str, list[int]]:
    """Long-tailed topic classification as tensor shards (tokens.npy, tokens.lengths.npy, labels.npy)."""
    rng = np.random.default_rng(seed)
    common = [f"w{i}" for i in range(300)]
    topics = [[f"t{c}x{j}" for j in range(12)] for c in range(n_classes)]
    words = common + [w for t in topics for w in t]
    vocab = vocabulary(words)
    zipf = 1.0 / np.arange(1, len(common) + 1)
    zipf /= zipf.sum()

    def sentence(c: int) -> str:
        n = int(rng.integers(4, max_length + 1))
        topical = rng.random(n) < 0.25
        return " ".join(
            topics[c][int(rng.integers(len(topics[c])))]
            if t
            else common[int(rng.choice(len(common), p=zipf))]
            for t in topical
        )

    sizes = {
        "train": long_tail_sizes(n_classes, n_max, ratio),
        "val": [val_per_class] * n_classes,
        "test": [test_per_class] * n_classes,
    }
    for split, per_class in sizes.items():
        labels = np.repeat(np.arange(n_classes), per_class)
        rng.shuffle(labels)
        tokens = np.zeros((len(labels), max_length), dtype=np.int64)
        lengths = np.zeros(len(labels), dtype=np.int64)
        for i, c in enumerate(labels):
            ids = tokenize(sentence(int(c)), vocab, max_length)
            tokens[i, : len(ids)] = ids
            lengths[i] = len(ids)
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "tokens.npy", tokens)
        np.save(folder / "tokens.lengths.npy", lengths)
        np.save(folder / "labels.npy", labels.astype(np.int64))
    (out / "classes.txt").write_text("\n".join(f"topic_{c}" for c in range(n_classes)) + "\n")
    (out / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    return sizes
