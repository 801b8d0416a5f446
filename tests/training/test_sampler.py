from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training.sampler import ClassBalancedSampler, largest_remainder

label_arrays = st.lists(st.integers(0, 5), min_size=8, max_size=400).map(lambda xs: np.array(xs + [0, 1]))


@settings(max_examples=60, deadline=None)
@given(
    labels=label_arrays, world=st.integers(1, 4), q=st.sampled_from([0.0, 0.5, 1.0]), epoch=st.integers(0, 50)
)
def test_equal_lengths_and_per_class_balance_across_ranks(
    labels: np.ndarray, world: int, q: float, epoch: int
) -> None:
    samplers = [ClassBalancedSampler(labels, world, r, q=q, seed=7) for r in range(world)]
    shares = []
    for s in samplers:
        s.set_epoch(epoch)
        shares.append(np.array(list(s)))
    assert len({len(x) for x in shares}) == 1
    assert sum(len(x) for x in shares) == (len(labels) // world) * world
    n_classes = labels.max() + 1
    counts = np.array([np.bincount(labels[x], minlength=n_classes) for x in shares])
    assert (counts.max(axis=0) - counts.min(axis=0)).max() <= 1


@settings(max_examples=40, deadline=None)
@given(labels=label_arrays, world=st.integers(1, 4), epoch=st.integers(0, 20))
def test_natural_q_draws_each_sample_at_most_once_and_disjointly(
    labels: np.ndarray, world: int, epoch: int
) -> None:
    drawn = []
    for r in range(world):
        s = ClassBalancedSampler(labels, world, r, q=1.0, seed=3)
        s.set_epoch(epoch)
        drawn.extend(s)
    assert len(drawn) == len(set(drawn))


def test_class_frequencies_follow_q() -> None:
    labels = np.repeat(np.arange(4), [800, 200, 50, 10])
    counts = np.array([800, 200, 50, 10], dtype=float)
    for q in (0.0, 0.5, 1.0):
        s = ClassBalancedSampler(labels, 1, 0, q=q, seed=1, samples_per_epoch=10_600)
        got = np.bincount(labels[np.array(list(s))], minlength=4) / 10_600
        want = counts**q / (counts**q).sum()
        np.testing.assert_allclose(got, want, atol=1e-3)


def test_same_seed_and_epoch_same_draw_different_epoch_different() -> None:
    labels = np.repeat(np.arange(3), [50, 20, 5])
    a, b = (
        ClassBalancedSampler(labels, 2, 1, q=0.5, seed=11),
        ClassBalancedSampler(labels, 2, 1, q=0.5, seed=11),
    )
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b)
    b.set_epoch(5)
    assert list(a) != list(b)


def test_two_ranks_same_count_and_mix_within_two_percent() -> None:
    rng = np.random.default_rng(0)
    labels = rng.choice(10, size=5000, p=np.geomspace(1, 0.01, 10) / np.geomspace(1, 0.01, 10).sum())
    shares = [np.array(list(ClassBalancedSampler(labels, 2, r, q=0.5, seed=0))) for r in range(2)]
    assert len(shares[0]) == len(shares[1])
    mix = [np.bincount(labels[s], minlength=10) / len(s) for s in shares]
    assert np.abs(mix[0] - mix[1]).max() < 0.02


def test_fewer_samples_than_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="1 samples per epoch cannot give each of 2 ranks one sample"):
        ClassBalancedSampler(np.array([0]), 2, 0)


@pytest.mark.parametrize(
    ("weights", "total", "want"),
    [
        ([1, 1, 1], 10, [4, 3, 3]),  # tie on remainders: the earliest wins (stable)
        ([0.5, 0.3, 0.2], 7, [4, 2, 1]),  # 3.5, 2.1, 1.4: the one seat left goes to the .5
        ([0.2, 0.3, 0.5], 7, [1, 2, 4]),
        ([3, 1], 2, [2, 0]),  # 1.5, 0.5: tie again, first index
        ([5, 3, 2], 0, [0, 0, 0]),
        ([1], 9, [9]),
    ],
)
def test_largest_remainder_exact_apportionments(weights: list[float], total: int, want: list[int]) -> None:
    assert largest_remainder(np.array(weights, dtype=float), total).tolist() == want


@given(weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=10), total=st.integers(0, 1000))
def test_largest_remainder_is_hamiltons_apportionment(weights: list[float], total: int) -> None:
    counts = largest_remainder(np.array(weights), total)
    w = np.array(weights, dtype=np.float64)
    exact = w / w.sum() * total  # computed as the function does, so floors agree to the last bit
    floor = np.floor(exact).astype(int)
    assert counts.sum() == total
    # Each count is its quota rounded down, plus one seat for the largest remainders only.
    extra = counts - floor
    assert set(extra.tolist()) <= {0, 1}
    remainders = exact - floor
    if extra.any() and not extra.all():
        assert remainders[extra == 1].min() >= remainders[extra == 0].max() - 1e-9
