"""Request mixes, shapes and the SLO gate, without locust."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.mix import MixSettings, RequestMix, zipf_probabilities
from loadtests.report import RowStats, Slo, check_slo, load_slo
from loadtests.runner import parse_duration
from loadtests.shapes import ShapeParams, shape_tick


@given(keys=st.integers(1, 500), s=st.floats(0, 3))
def test_zipf_is_a_decreasing_distribution(keys: int, s: float) -> None:
    p = zipf_probabilities(keys, s)
    assert abs(p.sum() - 1) < 1e-9 and np.all(np.diff(p) <= 1e-15)


def test_hot_keys_dominate_and_the_cold_model_gets_its_fraction() -> None:
    mix = RequestMix(
        MixSettings(
            model="hot",
            n_features=4,
            keys=100,
            zipf_s=1.2,
            cold_model="cold",
            cold_fraction=0.1,
            regions=("a", "b"),
        )
    )
    draws = [mix.draw() for _ in range(20_000)]
    keys = np.array([k for _, k, _, _ in draws])
    assert np.mean(keys == 0) > 0.2 and np.mean(keys < 10) > 0.6
    cold = np.mean([m == "cold" for m, _, _, _ in draws])
    assert 0.08 < cold < 0.12
    assert {r for _, _, _, r in draws} == {"a", "b"}
    assert draws[0][2][0].shape == (1, 4)
    again = RequestMix(MixSettings(model="hot", n_features=4, keys=100))
    np.testing.assert_array_equal(again.rows, mix.rows)  # same key space in every process


def test_requests_follow_the_served_inputs_and_real_samples(tmp_path) -> None:
    from loadtests.wire import binary_request, json_request
    from training.datasets_builtin import write_topics_lt

    inputs = (("tokens", "INT64", (-1,)), ("mask", "BOOL", (3,)))
    mix = RequestMix(MixSettings(model="m", inputs=inputs, keys=5))
    _, _, row, _ = mix.draw()
    assert [(x.dtype, x.shape) for x in row] == [(np.int64, (1, 16)), (np.bool_, (1, 3))]
    body, headers = binary_request(mix.tensors(row))
    header = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    assert [(i["name"], i["datatype"], i["parameters"]["binary_data_size"]) for i in header["inputs"]] == [
        ("tokens", "INT64", 128), ("mask", "BOOL", 3),
    ]  # fmt: skip
    write_topics_lt(tmp_path, n_max=20, ratio=2, val_per_class=2, test_per_class=1)
    raw = RequestMix(
        MixSettings(model="m_raw", inputs=(("raw", "BYTES", (1,)),), keys=4, samples=str(tmp_path))
    )
    text = raw.rows[0][0][0, 0]
    assert isinstance(text, bytes) and text.split()[0].startswith((b"w", b"t"))
    body, _ = json_request(raw.tensors(raw.rows[0]))
    assert json.loads(body)["inputs"][0]["data"] == [text.decode()]
    real = RequestMix(
        MixSettings(model="m", inputs=(("tokens", "INT64", (-1,)),), keys=3, samples=str(tmp_path))
    )
    assert len(real.rows) == 3 and real.rows[0][0].dtype == np.int64 and real.rows[0][0].shape[0] == 1
    with pytest.raises(
        ValueError, match="pass --samples DATA_DIR so requests carry real encoded images or text"
    ):
        RequestMix(MixSettings(model="m_raw", inputs=(("raw", "BYTES", (1,)),), keys=2))


def test_settings_round_trip_through_the_environment() -> None:
    s = MixSettings(
        model="m",
        n_features=3,
        keys=7,
        zipf_s=0.5,
        cold_model="c",
        cold_fraction=0.2,
        regions=("x",),
        seed=4,
        inputs=(("image", "UINT8", (1, 8, 8)),),
        samples="/data",
    )
    assert MixSettings.from_env(s.to_env()) == s
    with pytest.raises(RuntimeError, match="must be set; run load tests through `skewserve loadtest`"):
        MixSettings.from_env({})


def test_shapes() -> None:
    p = ShapeParams(users=8, spawn_rate=2, duration_s=10)
    assert shape_tick("steady", p, 3) == (8, 2) and shape_tick("steady", p, 10) is None
    assert (
        shape_tick("ramp", p, 0)[0] == 1
        and shape_tick("ramp", p, 4)[0] == 4
        and shape_tick("ramp", p, 9)[0] == 8
    )
    assert (
        shape_tick("spike", p, 1)[0] == 2
        and shape_tick("spike", p, 5)[0] == 8
        and shape_tick("spike", p, 7)[0] == 2
    )
    with pytest.raises(ValueError, match="unknown shape 'wave'"):
        shape_tick("wave", p, 1)


def test_slo_gate() -> None:
    total = RowStats("", "Aggregated", 1000, 5, 100.0, 2.0, 9.0, 20.0)
    assert check_slo(total, Slo(p95_ms=10, p99_ms=25, error_rate=0.01)) == []
    assert check_slo(total, Slo(p95_ms=5, p99_ms=10, error_rate=0.001)) == [
        "p95 9.0 ms > 5 ms",
        "p99 20.0 ms > 10 ms",
        "error rate 0.0050 > 0.001",
    ]


def test_slo_file_errors_name_the_field(tmp_path: Path) -> None:
    f = tmp_path / "slo.yaml"
    f.write_text("p95_ms: -1\n")
    with pytest.raises(ValueError, match="p95_ms: Input should be greater than 0"):
        load_slo(f)
    f.write_text("p50: 3\n")
    with pytest.raises(ValueError, match="p50: Extra inputs are not permitted"):
        load_slo(f)


def test_durations() -> None:
    assert parse_duration("30s") == 30 and parse_duration("2m") == 120 and parse_duration("5") == 5
    with pytest.raises(ValueError, match="is not like 30s"):
        parse_duration("soon")


def test_the_readmes_example_slo_file_loads() -> None:
    root = Path(__file__).resolve().parents[2]
    assert "--slo loadtests/slo.example.yaml" in (root / "README.md").read_text()
    assert load_slo(root / "loadtests" / "slo.example.yaml") == Slo(p95_ms=250, p99_ms=500, error_rate=0.001)


def test_the_rate_plot_counts_completed_requests_not_locusts_rolling_average() -> None:
    from loadtests.report import completed_rates

    rows = [
        {"Timestamp": "100", "Requests/s": "0", "Total Request Count": "0", "Total Failure Count": "0"},
        {"Timestamp": "101", "Requests/s": "0", "Total Request Count": "1200", "Total Failure Count": "0"},
        {"Timestamp": "103", "Requests/s": "0", "Total Request Count": "3600", "Total Failure Count": "4"},
    ]
    assert completed_rates(rows) == ([0.0, 1200.0, 1200.0], [0.0, 0.0, 2.0])
