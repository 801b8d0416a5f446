"""`skewserve loadtest`: a bounded locust run (`loadtests.runner.run_loadtest`) gated on an SLO.

locust (and gevent with it) is imported inside the command so that `skewserve --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from skewserve.commands.options import comma_list
from skewserve.output import console, error, say, text


def loadtest_command(
    target: str = typer.Option(
        ..., "--target", help="Gateway (or Triton) URL: http://host:port, or host:port for gRPC."
    ),
    protocol: str = typer.Option("http-binary", "--protocol", help="http | http-binary | grpc"),
    model: str = typer.Option(..., "--model", help="Hot model name."),
    users: int = typer.Option(4, "--users", min=1),
    spawn_rate: float = typer.Option(4.0, "--spawn-rate"),
    duration: str = typer.Option("20s", "--duration", help="Bounded run time: 30s, 2m..."),
    requests: int | None = typer.Option(
        None, "--requests", min=1, help="Stop once this many requests were answered (or at --duration)."
    ),
    shape: str = typer.Option("steady", "--shape", help="steady | ramp | spike | soak"),
    keys: int = typer.Option(1000, "--keys", help="Distinct inputs (the key space)."),
    zipf: float = typer.Option(1.1, "--zipf", help="Zipf exponent of key popularity (0 = uniform)."),
    cold_model: str = typer.Option("", "--cold-model", help="A second, rarely used model."),
    cold_fraction: float = typer.Option(0.0, "--cold-fraction"),
    regions: str = typer.Option(
        "", "--regions", help="Pin requests to these regions at random (comma-separated)."
    ),
    metrics_url: str | None = typer.Option(
        None,
        "--metrics-url",
        help="The gateway's /metrics on its ops listener (listen.ops_port), e.g. "
        "http://127.0.0.1:8082/metrics; without it, no cache or spill-over figures.",
    ),
    slo: Path | None = typer.Option(
        None, "--slo", help="YAML with p95_ms, p99_ms, error_rate; breach = exit 1."
    ),
    out: Path = typer.Option(Path("runs/loadtest"), "--out"),
    samples: Path | None = typer.Option(
        None,
        "--samples",
        help="Data directory to draw real requests from (its val/ split): tensors for a tensor model, "
        "encoded images or text for a <model>_raw ensemble; default: synthetic tensors.",
    ),
) -> None:
    """Run a bounded locust load with skewed traffic; write CSV, HTML and PNG; gate on an SLO file.

    A gateway that requires API keys: export SKEWSERVE_API_KEY=<key> first (sent as x-api-key; an
    environment variable keeps the key out of shell history and process listings).

    Docs: README.md#walkthrough-what-make-demo-does-as-commands
    """
    # lazy: locust and gevent, kept out of --help
    from loadtests.mix import MixSettings
    from loadtests.report import load_slo
    from loadtests.runner import LoadTestSpec, model_inputs, parse_duration, run_loadtest

    try:
        slo_bounds = load_slo(slo) if slo else None
        seconds = parse_duration(duration)
        inputs = model_inputs(target, protocol, model)
        if protocol == "http" and any(d == "BYTES" for _, d, _ in inputs) and samples is not None:
            raise ValueError(
                f"{model} takes BYTES (raw images or text), which JSON cannot carry as bytes: "
                "use --protocol http-binary or grpc"
            )
        mix = MixSettings(
            model=model,
            inputs=inputs,
            samples=str(samples.resolve()) if samples is not None else "",
            keys=keys,
            zipf_s=zipf,
            cold_model=cold_model,
            cold_fraction=cold_fraction,
            regions=tuple(comma_list(regions)),
        )
        spec = LoadTestSpec(
            target=target,
            protocol=protocol,
            users=users,
            spawn_rate=spawn_rate,
            duration_s=seconds,
            max_requests=requests,
            shape=shape,
            out_dir=out,
            metrics_url=metrics_url,
            slo=slo_bounds,
            mix=mix,
        )
    except Exception as exc:  # bad options or an unreachable target: say which
        error(exc)
        raise typer.Exit(2) from exc
    with console.status(text(f"locust: {users} {protocol} users, {shape} shape, {seconds:.0f}s")):
        try:
            result = run_loadtest(spec)
        except RuntimeError as exc:
            error(exc)
            raise typer.Exit(1) from exc
    print_loadtest(result)
    if result.breaches:
        error("; ".join(result.breaches), label="SLO breached")
        raise typer.Exit(1)


def print_loadtest(result: Any) -> None:
    """A table of each request kind's latency and rate, then the gateway's figures and the files."""
    table = Table(title="load test")
    for col in ("request", "requests", "failures", "rps", "p50 ms", "p95 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "request" else "right", no_wrap=True)
    for r in [*result.rows, result.total]:
        table.add_row(
            text(r.name),
            str(r.requests),
            str(r.failures),
            f"{r.rps:.1f}",
            f"{r.p50_ms:.1f}",
            f"{r.p95_ms:.1f}",
            f"{r.p99_ms:.1f}",
        )
    console.print(table)
    extra = []
    if result.cache_hit_rate is not None:
        extra.append(f"gateway cache hit rate {100 * result.cache_hit_rate:.1f}%")
    if result.spillovers is not None:
        extra.append(f"spill-overs {result.spillovers:.0f}")
    if extra:
        say(", ".join(extra))
    say("files: " + ", ".join(str(p) for p in result.files.values()))
