"""`skewserve plan` against hand-computed cases (every expected number is worked out in a comment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from skewserve.plan import (
    Measurement,
    PlanInputError,
    PlanOptions,
    Price,
    PriceTable,
    RegionTraffic,
    TrafficProfile,
    capacity_from_loadtest,
    capacity_from_measurements,
    load_traffic,
    make_plan,
    servers_needed,
)

CURVE = [0.5] * 12 + [1.0] * 12
PRICES = PriceTable(instance_types={"g": Price(on_demand=1.0, reserved=0.6, spot=0.3)})
TRAFFIC = TrafficProfile(regions={"a": RegionTraffic(peak_rps=1000, curve=CURVE)})
OPTS = PlanOptions(spot_share=0.5, utilization=1.0, min_servers=1, spare_servers=1)


def test_servers_cost_and_autoscaler_bounds_by_hand() -> None:
    plan = make_plan(TRAFFIC, {"g": 100.0}, PRICES, OPTS)
    (a,) = plan.regions
    # 500 rps / 100 per server = 5 servers for 12 h, 1000 / 100 = 10 for 12 h
    assert a.servers == [5] * 12 + [10] * 12
    assert (a.baseline, a.autoscaler_min, a.autoscaler_max) == (5, 5, 11)  # max = peak 10 + 1 spare
    # quiet hour: 5 reserved x 0.6 = 3.00; busy: 3.00 + 5 elastic x (0.5 x 0.3 + 0.5 x 1.0) = 6.25
    assert a.hourly_cost == pytest.approx([3.0] * 12 + [6.25] * 12)
    # day 12 x 3 + 12 x 6.25 = 111; month 111 x 730 / 24 = 3376.25
    assert plan.monthly_cost == pytest.approx(3376.25)
    assert plan.cost_per_hour == pytest.approx(3376.25 / 730)
    # requests a day: 3600 x (12 x 500 + 12 x 1000) = 64.8 M; 111 $ / 64.8 M = 1.71296 $ per million
    assert plan.cost_per_million == pytest.approx(111 / 64.8)
    # without spot: busy hour 3 + 5 x 1.0 = 8, day 36 + 96 = 132, month 4015: spot saves 638.75
    assert plan.monthly_cost_without_spot == pytest.approx(4015.0)
    assert plan.summary()["spot_saves_per_month"] == pytest.approx(638.75)
    # all on demand: 180 server-hours a day x 1.0 x 730 / 24 = 5475
    assert plan.monthly_cost_all_on_demand == pytest.approx(5475.0)


def test_cache_hit_rate_shrinks_the_fleet_and_the_bill_by_hand() -> None:
    plan = make_plan(TRAFFIC, {"g": 100.0}, PRICES, OPTS.model_copy(update={"cache_hit_rate": 0.2}))
    (a,) = plan.regions
    # backend 400 and 800 rps -> 4 and 8 servers; quiet 4 x 0.6 = 2.4, busy 2.4 + 4 x 0.65 = 5.0
    assert a.servers == [4] * 12 + [8] * 12
    assert plan.monthly_cost == pytest.approx((12 * 2.4 + 12 * 5.0) * 730 / 24)  # 2701
    # without the cache it is the first case's 3376.25: the cache saves 675.25 a month
    assert plan.summary()["cache_saves_per_month"] == pytest.approx(675.25)
    # cost per million counts every client request, hits included: 88.8 $ / 64.8 M
    assert plan.cost_per_million == pytest.approx(88.8 / 64.8)


def test_an_edge_tier_counts_the_cloud_servers_it_saves_by_hand() -> None:
    """An edge cascade escalating half the requests: the cloud serves 250 and 500 rps."""
    plan = make_plan(TRAFFIC, {"g": 100.0}, PRICES, OPTS.model_copy(update={"escalation_rate": 0.5}))
    (a,) = plan.regions
    # 250 / 100 -> 3 servers (rounded up), 500 / 100 -> 5
    assert a.servers == [3] * 12 + [5] * 12
    # quiet 3 reserved x 0.6 = 1.8; busy 1.8 + 2 elastic x 0.65 = 3.1; day 58.8; month x 730 / 24
    assert plan.monthly_cost == pytest.approx(58.8 * 730 / 24)  # 1788.5
    edge = plan.summary()["edge"]
    # without the edge it is the first case's 3376.25 and 180 server-hours a day (12 x 5 + 12 x 10)
    assert edge["saves_per_month"] == pytest.approx(3376.25 - 1788.5)
    assert (edge["server_hours_per_day"], edge["server_hours_per_day_saved"]) == (96, 84)
    # the naive bill has neither cache nor edge
    assert plan.monthly_cost_all_on_demand == pytest.approx(5475.0)


def test_the_escalation_rate_is_read_from_a_calibrated_rule_file(tmp_path: Path) -> None:
    from skewserve.plan import escalation_from_rule

    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"validation": {"cascade": {"escalation_rate": 0.3}}}))
    assert escalation_from_rule(rule) == 0.3
    rule.write_text(json.dumps({"format": "skewserve.cascade-rule/1"}))
    with pytest.raises(PlanInputError, match="has no validation.cascade.escalation_rate"):
        escalation_from_rule(rule)
    with pytest.raises(PlanInputError, match="does not exist"):
        escalation_from_rule(tmp_path / "missing.json")


def test_utilisation_headroom_rounds_up_and_min_servers_holds() -> None:
    assert servers_needed(150, 100, 0.7, 1) == 3  # 150 / 70 = 2.14 -> 3
    assert servers_needed(140, 100, 0.7, 1) == 2  # exactly 2: no spurious third server
    assert servers_needed(10, 100, 0.7, 2) == 2  # redundancy floor


def test_capacity_is_the_best_rps_per_server_within_the_slo() -> None:
    ms = [
        Measurement(instance_type="g", servers=2, rps=200, p99_ms=40),
        Measurement(instance_type="g", servers=2, rps=300, p99_ms=80),
        Measurement(instance_type="h", servers=1, rps=500, p99_ms=120),
    ]
    assert capacity_from_measurements(ms, 50) == {"g": 100.0}  # h never met 50 ms
    assert capacity_from_measurements(ms, 100) == {"g": 150.0}
    assert capacity_from_measurements(ms, 150) == {"g": 150.0, "h": 500.0}
    with pytest.raises(PlanInputError, match="no measurement meets the p99 SLO of 10 ms"):
        capacity_from_measurements(ms, 10)


def test_each_region_gets_the_cheapest_type_per_capacity_and_regional_prices() -> None:
    prices = PriceTable(
        instance_types={
            "g": Price(on_demand=1.0, reserved=0.6, spot=0.3),  # 0.0100 $ per rps-hour
            "h": Price(on_demand=2.5, reserved=1.5, spot=0.8),  # 0.0083 $ per rps-hour
        },
        regions={"b": {"h": Price(on_demand=4.0, reserved=2.4, spot=1.2)}},  # 0.0133 in region b
    )
    traffic = TrafficProfile(
        regions={"a": RegionTraffic(peak_rps=600, curve=CURVE), "b": RegionTraffic(peak_rps=600, curve=CURVE)}
    )
    plan = make_plan(traffic, {"g": 100.0, "h": 300.0}, prices, OPTS)
    assert {r.region: r.instance_type for r in plan.regions} == {"a": "h", "b": "g"}
    a = plan.regions[0]
    assert a.servers == [1] * 12 + [2] * 12  # 300 / 300 and 600 / 300


def test_loadtest_result_is_read_as_a_measurement(tmp_path: Path) -> None:
    header = (
        "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
        "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,"
        "99.9%,99.99%,100%\n"
    )
    row = "1000,0,3,4.3,0.9,96,438,{rps},0.0,3,4,5,6,8,12,15,{p99},31,47,96\n"
    (tmp_path / "locust_stats.csv").write_text(
        header
        + "POST,http-json lt,"
        + row.format(rps=1005.4, p99=19)
        + ",Aggregated,"
        + row.format(rps=1005.4, p99=19)
    )
    assert capacity_from_loadtest(tmp_path, 2, "cpu-2", 50) == {"cpu-2": pytest.approx(502.7)}
    with pytest.raises(PlanInputError, match="no measurement meets the p99 SLO of 10"):
        capacity_from_loadtest(tmp_path, 2, "cpu-2", 10)
    with pytest.raises(PlanInputError, match="locust_stats.csv does not exist"):
        capacity_from_loadtest(tmp_path / "nope", 1, "x", 50)


def test_a_cache_dominated_load_test_is_warned_about(tmp_path: Path) -> None:
    """Issue 25 item 12: a run the cache answered does not measure the servers."""
    from skewserve.plan import loadtest_warnings

    assert "cache hit rate is unknown" in loadtest_warnings(tmp_path)[0]
    (tmp_path / "summary.json").write_text('{"cache_hit_rate": 0.95}')
    assert loadtest_warnings(tmp_path) == [
        "95% of the load test's requests were cache hits: its requests/s measure the cache, not the "
        "servers. Measure capacity with the cache off, or --zipf 0 and --keys larger than the run's requests"
    ]
    (tmp_path / "summary.json").write_text('{"cache_hit_rate": 0.1}')
    assert loadtest_warnings(tmp_path) == []


def test_bad_inputs_name_the_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "traffic.yaml"
    bad.write_text(yaml.safe_dump({"regions": {"a": {"peak_rps": 10, "curve": [1.0] * 23}}}))
    with pytest.raises(
        PlanInputError, match=r"traffic.yaml: regions\.a\.curve: .*needs 24 hourly values, got 23"
    ):
        load_traffic(bad)
    with pytest.raises(
        PlanInputError,
        match=r"no price for instance type 'z' \(the prices file has \[.*\]\): pass the --instance-type the "
        "load test ran on, or add it under instance_types",
    ):
        make_plan(TRAFFIC, {"z": 100.0}, PRICES, OPTS)


def test_plan_command_prints_the_table_and_writes_json_and_png(tmp_path: Path) -> None:
    (tmp_path / "traffic.yaml").write_text(
        yaml.safe_dump({"regions": {"a": {"peak_rps": 1000, "curve": CURVE}}})
    )
    (tmp_path / "prices.yaml").write_text(
        yaml.safe_dump({"instance_types": {"g": {"on_demand": 1.0, "reserved": 0.6, "spot": 0.3}}})
    )
    (tmp_path / "capacity.yaml").write_text(
        yaml.safe_dump({"measurements": [{"instance_type": "g", "servers": 1, "rps": 100, "p99_ms": 20}]})
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "skewserve",
            "plan",
            "--traffic",
            str(tmp_path / "traffic.yaml"),
            "--prices",
            str(tmp_path / "prices.yaml"),
            "--capacity",
            str(tmp_path / "capacity.yaml"),
            "--slo-p99-ms",
            "50",
            "--spot-share",
            "0.5",
            "--utilization",
            "1",
            "--min-servers",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cost: $4.62/hour, $3,376.25/month" in res.stdout
    assert "cost per million inferences: $1.7130" in res.stdout
    summary = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert summary["regions"]["a"]["autoscaler"] == {"min": 5, "max": 11}
    assert Image.open(tmp_path / "out" / "plan.png").size[0] > 100
    rule = tmp_path / "rule.json"
    rule.write_text(json.dumps({"validation": {"cascade": {"escalation_rate": 0.5}}}))
    edge = subprocess.run(
        [*res.args[:-2], "--cascade-rule", str(rule), "--out", str(tmp_path / "edge")],
        capture_output=True,
        text=True,
    )
    assert edge.returncode == 0, edge.stdout + edge.stderr
    assert (
        "edge tier: 50.0% of requests answered at the edge; the cloud needs 96 server-hours/day, 84 fewer "
        "(saves $1,587.75/month on the cloud side; the edge's own boxes are not priced"
        in " ".join(edge.stdout.split())
    )
    missing = subprocess.run(
        [sys.executable, "-m", "skewserve", "plan", "--traffic", "t", "--prices", "p"],
        capture_output=True,
        text=True,
    )
    assert (
        missing.returncode == 2 and "give exactly one of --capacity FILE or --loadtest DIR" in missing.stderr
    )


def test_example_files_in_deploy_plan_load() -> None:
    from skewserve.plan import load_capacity, load_prices

    root = Path(__file__).resolve().parents[2] / "deploy" / "plan"
    plan = make_plan(
        load_traffic(root / "traffic.example.yaml"),
        load_capacity(root / "capacity.example.yaml", 50),
        load_prices(root / "prices.example.yaml"),
        PlanOptions(cache_hit_rate=0.3, spot_share=0.5),
    )
    # docs/cost.md's example figures
    assert plan.summary()["monthly_cost"] == pytest.approx(2812.74)
    assert [(r.region, r.autoscaler_min, r.autoscaler_max) for r in plan.regions] == [
        ("us-east", 2, 6),
        ("eu-west", 2, 4),
    ]


def test_the_readme_example_is_what_the_command_prints(tmp_path: Path) -> None:
    """Every figure of docs/cost.md's planner example: its command, run as written, prints that table
    and those summary lines (rich's box characters aside)."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "docs" / "cost.md").read_text()
    start = readme.index("    skewserve plan --traffic deploy/plan/traffic.example.yaml")
    block = readme[start : readme.index("![plan:", start)]
    command_text, _, shown = block.partition("\n\n")
    args = command_text.replace("\\\n", " ").split()[2:]
    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "plan", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert res.returncode == 0, res.stdout + res.stderr

    def rows(text: str, bar: str) -> list[list[str]]:
        return [
            [cell.strip() for cell in line.strip().strip(bar).split(bar)]
            for line in text.splitlines()
            if line.strip().startswith(bar)
        ]

    shown_lines = [line.strip() for line in shown.strip().splitlines()]
    printed_lines = [line.strip() for line in res.stdout.splitlines()]
    header, *table = rows(shown, "|")
    assert [header] == rows(res.stdout, "┃") and table == rows(res.stdout, "│")
    assert len(table) == 2
    summary = [line for line in shown_lines if not line.startswith("|")]
    assert summary and all(line in printed_lines for line in summary), (summary, printed_lines)
