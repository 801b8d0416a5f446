"""`skewserve plan`: servers per region over the day and their cost (`skewserve.plan.make_plan`).

The planner (pydantic, matplotlib) is imported inside the command so that `--help` stays instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from skewserve.commands.foreground import setup_logging
from skewserve.output import console, error, notice, say, text


def plan_command(
    traffic: Path = typer.Option(
        ..., "--traffic", help="YAML: per region peak_rps and a 24-value daily curve."
    ),
    prices: Path = typer.Option(
        ..., "--prices", help="YAML: per instance type on_demand, reserved, spot $/h."
    ),
    capacity: Path | None = typer.Option(
        None, "--capacity", help="YAML: measurements (instance_type, servers, rps, p99_ms)."
    ),
    loadtest_dir: Path | None = typer.Option(
        None, "--loadtest", help="Use a `skewserve loadtest --out` directory as the measurement."
    ),
    servers_tested: int = typer.Option(
        1, "--servers-tested", min=1, help="Triton servers behind --loadtest."
    ),
    instance_type: str = typer.Option("local", "--instance-type", help="Instance type --loadtest ran on."),
    slo_p99_ms: float = typer.Option(
        100.0, "--slo-p99-ms", min=0.001, help="Latency SLO capacity is read at."
    ),
    cache_hit_rate: float = typer.Option(0.0, "--cache-hit-rate", min=0.0, max=0.99),
    escalation_rate: float | None = typer.Option(
        None,
        "--escalation-rate",
        min=0.0,
        max=1.0,
        help="With an edge tier: share of requests its cascade sends on to these servers.",
    ),
    cascade_rule: Path | None = typer.Option(
        None,
        "--cascade-rule",
        help="With an edge tier: its rule file (skewserve cascade calibrate); the escalation rate it measured.",
    ),
    spot_share: float = typer.Option(0.0, "--spot-share", min=0.0, max=1.0, help="Elastic servers on spot."),
    utilization: float = typer.Option(
        0.7, "--utilization", min=0.01, max=1.0, help="Planned load / capacity."
    ),
    min_servers: int = typer.Option(2, "--min-servers", min=1, help="Per region, at every hour."),
    out: Path = typer.Option(Path("runs/plan"), "--out", help="Writes plan.json and plan.png here."),
) -> None:
    """Servers per region over the day, cost per hour and month, cost per million inferences.

    Docs: docs/cost.md"""
    # lazy: the planner (pydantic; matplotlib when it plots), kept out of --help
    from skewserve.plan import (
        PlanInputError,
        PlanOptions,
        capacity_from_loadtest,
        escalation_from_rule,
        load_capacity,
        load_prices,
        load_traffic,
        loadtest_warnings,
        make_plan,
        plot_plan,
    )

    setup_logging(False)
    if (capacity is None) == (loadtest_dir is None):
        raise typer.BadParameter(
            "give exactly one of --capacity FILE or --loadtest DIR", param_hint="--capacity"
        )
    try:
        caps = (
            load_capacity(capacity, slo_p99_ms)
            if capacity is not None
            else capacity_from_loadtest(loadtest_dir, servers_tested, instance_type, slo_p99_ms)  # type: ignore[arg-type]
        )
        if escalation_rate is not None and cascade_rule is not None:
            raise typer.BadParameter(
                "give --escalation-rate or --cascade-rule, not both", param_hint="--escalation-rate"
            )
        escalation = escalation_from_rule(cascade_rule) if cascade_rule is not None else escalation_rate
        opts = PlanOptions(
            cache_hit_rate=cache_hit_rate,
            escalation_rate=1.0 if escalation is None else escalation,
            spot_share=spot_share,
            utilization=utilization,
            min_servers=min_servers,
        )
        plan = make_plan(load_traffic(traffic), caps, load_prices(prices), opts)
    except PlanInputError as exc:
        error(exc)
        raise typer.Exit(2) from exc
    for note in loadtest_warnings(loadtest_dir) if loadtest_dir is not None else []:
        notice(note, "warning")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan.summary(), indent=2))
    plot_plan(plan, out / "plan.png")
    print_plan(plan, out)


def print_plan(plan: Any, out: Path) -> None:
    """A table of each region's servers and cost, then the totals and what cache and spot save."""
    table = Table(title="skewserve plan (per region)")
    for col in ("region", "type", "rps/server", "servers min-max", "reserved", "autoscaler", "$/month"):
        table.add_column(col, no_wrap=True)
    for r in plan.regions:
        table.add_row(
            *map(
                text,
                (
                    r.region,
                    r.instance_type,
                    f"{r.capacity_rps:g}",
                    f"{min(r.servers)}-{max(r.servers)}",
                    r.baseline,
                    f"{r.autoscaler_min}-{r.autoscaler_max}",
                    f"{r.monthly_cost:,.2f}",
                ),
            )
        )
    console.print(table)
    s = plan.summary()
    say(f"cost: ${s['cost_per_hour']:,.2f}/hour, ${s['monthly_cost']:,.2f}/month")
    say(f"cost per million inferences: ${s['cost_per_million_inferences']:.4f}")
    say(
        f"cache saves ${s['cache_saves_per_month']:,.2f}/month, spot saves ${s['spot_saves_per_month']:,.2f}/month"
    )
    edge = s["edge"]
    if edge["escalation_rate"] < 1:
        say(
            f"edge tier: {100 * (1 - edge['escalation_rate']):.1f}% of requests answered at the edge; the cloud "
            f"needs {edge['server_hours_per_day']} server-hours/day, {edge['server_hours_per_day_saved']} fewer "
            f"(saves ${edge['saves_per_month']:,.2f}/month on the cloud side; the edge's own boxes are not priced, "
            "and the cloud is not sized for the edge being down)"
        )
    say(f"all on demand without cache or edge: ${s['all_on_demand_monthly_cost']:,.2f}/month")
    say(f"written: {out / 'plan.json'}, {out / 'plan.png'}")
