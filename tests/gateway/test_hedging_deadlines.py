"""Hedging and deadlines against a server made slow by a real delaying TCP proxy."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from skewserve.ports import free_port
from tests.gateway.conftest import gateway_config
from tests.waiting import wait_until

BODY = json.dumps(
    {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.3] * 8}]}
).encode()
DELAY_S = 0.3


HUNG_S = 60.0  # longer than any test waits: a server behind this never answers in time, whatever the load


@pytest.fixture()
def make_pair(fleet) -> Iterator[Callable[[float], dict[str, list[tuple[str, str, str]]]]]:
    """us-east: one direct server and the other behind proxies adding `delay_s` to each response."""
    procs: list[subprocess.Popen[bytes]] = []

    def make(delay_s: float) -> dict[str, list[tuple[str, str, str]]]:
        """HTTP: only inference answers are delayed (probes, over HTTP, pass at once); gRPC: all."""
        fast, slow = fleet["us-east"]
        ports = (free_port(), free_port())
        for p, t, mode in zip(ports, (slow.http_port, slow.grpc_port), (["--only-infer"], []), strict=True):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "loadtests.delay_proxy", str(p), str(t), str(delay_s), *mode]
                )
            )
        for port in ports:
            wait_until(lambda port=port: _accepts(port), 10, f"the delay proxy on port {port}")
        return {
            "us-east": [
                ("fast", fast.http_address, fast.grpc_address),
                ("slow", f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"),
            ]
        }

    yield make
    for p in procs:
        p.kill()
        p.wait(5)


def _config(servers: dict[str, list[tuple[str, str, str]]], **overrides: object) -> dict:
    # Probes go over HTTP, which the proxy delays only for inference answers.
    overrides = {"upstream_protocol": "http", "health": {"timeout_s": 5.0, "interval_s": 0.5}, **overrides}
    cfg = gateway_config({}, **overrides)
    cfg["regions"] = [
        {"name": r, "servers": [{"name": n, "http": h, "grpc": g} for n, h, g in s]}
        for r, s in servers.items()
    ]
    return cfg


def _post(address: str, **headers: str) -> tuple[int, dict]:
    """Status and headers (or the error body). Which server answered is in `x-skewserve-server`: the
    slow one can only answer after its delay, so the header, not a stopwatch, says who waited."""
    req = urllib.request.Request(f"http://{address}/v2/models/lt_nocache/infer", data=BODY, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _hedges(gw) -> float:
    lines = [
        line
        for line in gw.metrics().splitlines()
        if line.startswith('skewserve_gateway_hedges_total{model="lt_nocache"}')
    ]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_hedged_requests_do_not_wait_for_the_slow_server(make_pair, make_gateway) -> None:
    # The slow server never answers in time: every answer from it would be a missing hedge.
    gw = make_gateway(
        _config(
            make_pair(HUNG_S),
            balancing={"policy": "round_robin"},
            hedging={"models": ["lt_nocache"], "min_delay_ms": 20},
            # A budget that starts with 100 tokens: every one of the 12 hedges below is paid for
            # however fast the requests come (the budget's own tests are in test_units.py).
            retries={"min_retries_per_s": 100},
        )
    )
    results = [_post(gw.http) for _ in range(24)]
    assert [status for status, _ in results] == [200] * 24
    # Round robin sent primaries to the slow server too (it counts them), yet every answer came from
    # the fast one: each request routed to the slow server was hedged and the hedge won the race.
    assert gw.server("slow")["requests"] >= 12
    assert [headers["x-skewserve-server"] for _, headers in results] == ["fast"] * 24
    assert _hedges(gw) >= 12
    # The later hedges waited the fast server's observed p95, not the 20 ms floor (dispatch.hedge_delay):
    # it had the samples for it.
    assert gw.server("fast")["latency_samples"] >= 8 + 4


def test_without_hedging_round_robin_waits_for_the_slow_server(make_pair, make_gateway) -> None:
    gw = make_gateway(_config(make_pair(DELAY_S), balancing={"policy": "round_robin"}))
    answered_by = [_post(gw.http)[1]["x-skewserve-server"] for _ in range(6)]
    # The contrast that makes the test above meaningful: without hedging the slow server's (late)
    # answers reach the client, every other one under round robin.
    assert sorted(answered_by) == ["fast"] * 3 + ["slow"] * 3
    assert _hedges(gw) == 0


def test_deadline_header_bounds_the_wait_with_504(make_pair, make_gateway) -> None:
    only_slow = {"us-east": [make_pair(HUNG_S)["us-east"][1]]}
    # Timeouts count as failures: keep the lone server in rotation for this test's several timeouts.
    gw = make_gateway(
        _config(
            only_slow, retries={"max_attempts": 1}, health={"timeout_s": 5.0, "eject_after_failures": 100}
        )
    )
    # The only server never answers in time: a 504 can only come from the 100 ms deadline.
    status, body = _post(gw.http, **{"x-skewserve-timeout-ms": "100"})
    assert status == 504 and "no response within" in body["error"]
    timed = json.dumps(
        {**json.loads(BODY), "parameters": {"timeout": 100_000}}
    ).encode()  # KServe/Triton: microseconds
    req = urllib.request.Request(f"http://{gw.http}/v2/models/lt_nocache/infer", data=timed)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 504 and "no response within" in json.loads(info.value.read())["error"]
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(gw.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 8), np.float32))
    with pytest.raises(InferenceServerException) as g_info:
        client.infer("lt_nocache", [inp], timeout=100_000)  # tritonclient sends it as the `timeout` parameter
    assert g_info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    with pytest.raises(InferenceServerException) as g_info:
        client.infer("lt_nocache", [inp], client_timeout=0.1)  # the gRPC call deadline
    assert g_info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    status, body = _post(gw.http, **{"x-skewserve-timeout-ms": "soon"})
    assert (
        status == 400
        and body["error"] == "x-skewserve-timeout-ms must be a number of milliseconds, got 'soon'"
    )


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
