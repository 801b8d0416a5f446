"""The inference pipeline and the HTTP infer path served from the protocol (gateway/pipeline/run.py,
gateway/fronts/infer_exchange.py `InferExchange`): keep-alive and pipelined requests on one
connection answered in order, infer beside the FastAPI routes; per-step costs when asked for."""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from loadtests.wire import binary_request
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config
from tests.gateway.test_workers import ROW, grpc_infer, http_infer

STEPS = {"admission", "body", "parse", "dispatch", "respond", "record"}


def _request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


def _responses(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`n` HTTP/1.1 responses read off one socket, in the order they came."""
    buf = b""
    out = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(out)} of {n} responses"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        while len(buf) < length:
            chunk = sock.recv(65536)
            assert chunk, "connection closed inside a response body"
            buf += chunk
        out.append((int(lines[0].split()[1]), headers, buf[:length]))
        buf = buf[length:]
    return out


def test_pipelined_requests_on_one_connection_are_answered_in_order(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    body, headers = binary_request(ROW, outputs=("probabilities",))
    other = np.full((1, 8), 3.0, dtype=np.float32)
    body2, headers2 = binary_request(other, outputs=("probabilities",))
    batch = b"".join(
        (
            _request("POST", "/v2/models/lt/infer", {**headers, "x-request-id": "first"}, body),
            _request("POST", "/v2/models/no_such_model/infer", headers, body),
            _request("GET", "/v2/health/live", {}),
            _request("POST", "/v2/models/lt/infer", {**headers2, "x-request-id": "last"}, body2),
        )
    )
    with socket.create_connection((gw.host, gw.http_port), timeout=10) as sock:
        sock.sendall(batch)  # all four before any answer: the protocol queues them
        answers = _responses(sock, 4)
        # and the connection is kept alive for a fifth
        sock.sendall(_request("POST", "/v2/models/lt/infer", headers, body))
        (fifth,) = _responses(sock, 1)
    statuses = [status for status, _, _ in answers]
    assert statuses[0] == 200 and statuses[2] == 200 and statuses[3] == 200
    assert 400 <= statuses[1] < 500, answers[1]
    assert b"no_such_model" in answers[1][2]  # Triton's own words, on the right request
    assert answers[0][1]["x-request-id"] == "first" and answers[3][1]["x-request-id"] == "last"
    assert fifth[0] == 200 and fifth[2] == answers[0][2]  # the same input, the same answer
    assert answers[3][2] != answers[0][2]  # each answer is its own request's


def test_per_step_costs_are_exported_when_asked_for(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    timed = make_gateway(gateway_config(fleet, step_timing=True, cache={"backend": "none"}))
    for _ in range(3):
        assert http_infer(timed)[0] == 200
    for _ in range(2):
        assert grpc_infer(timed).model_name == "lt"
    exported: set[str] = set()  # steps with a time series (its value is a benchmark's business)
    calls: dict[str, float] = {}
    for family in text_string_to_metric_families(timed.metrics()):
        for sample in family.samples:
            if sample.name == "skewserve_gateway_step_seconds_total":
                exported.add(sample.labels["step"])
            elif sample.name == "skewserve_gateway_step_calls_total":
                calls[sample.labels["step"]] = sample.value
    assert STEPS <= exported and STEPS <= set(calls), (exported, calls)
    # every request, HTTP or gRPC, passed every step once (admission twice: before and after the body)
    assert calls["record"] == calls["parse"] == calls["dispatch"] == calls["respond"] == 5
    untimed = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
    assert http_infer(untimed)[0] == 200
    assert "skewserve_gateway_step_seconds" not in untimed.metrics()


def test_a_request_naming_no_model_is_still_rate_limited(
    fleet: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    """The model list and the rate limit run once the model is named, and "" is a name: a client
    over its rate gets 429 whatever its path names (here the empty model of /v2/models//infer)."""
    gw = make_gateway(
        gateway_config(
            fleet, cache={"backend": "none"}, limits={"per_client_rate_per_s": 0.01, "per_client_burst": 1}
        )
    )
    statuses = [http_infer(gw, model="")[0] for _ in range(3)]
    assert statuses[0] != 429 and statuses[1:] == [429, 429], statuses
