"""Hostile HTTP request bodies against a real Triton and gateway: a client changes only its own answer.

Duplicate JSON keys, malformed JSON, compressed and zip-bomb bodies, huge bodies and slow uploads
(issue 9, items 1, 4, 5, 11): each asserts what a client observes, against direct Triton's answer.
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.gateway.conftest import (
    GatewayUnderTest,
    gateway_config,
    launch_gateway,
)
from tests.gateway.relay import TcpRelay
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
MAX_BATCH = 8


@pytest.fixture(scope="module")
def gw(one_triton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayUnderTest]:
    """Cache on for `lt` and a batch limit: the configuration in which the gateway reads bodies."""
    g = launch_gateway(
        gateway_config(one_triton, limits={"max_batch_size": MAX_BATCH}), tmp_path_factory.mktemp("gw")
    )
    yield g
    g.stop()


def _direct(one_triton) -> str:
    return one_triton["us-east"][0].http_address


def _row(seed: int, rows: int = 1) -> list[float]:
    return [round(float(v), 4) for v in np.random.default_rng(seed).standard_normal(rows * 8) * 10]


def _input(values: list[float], rows: int = 1) -> str:
    return json.dumps({"name": "features", "shape": [rows, 8], "datatype": "FP32", "data": values})


def _post(
    address: str, body: bytes, model: str = "lt", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(address, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _outputs(raw: bytes) -> dict[str, Any]:
    return {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}


# -- 1. duplicate keys --------------------------------------------------------------------------
def _poison_cases(a: list[float], b: list[float]) -> dict[str, tuple[str, str, str]]:
    """name -> (attacker body, victim body, the duplicated key), the victim asking for B."""
    a_in, b_in = _input(a), _input(b)
    return {
        "top-level inputs": (f'{{"inputs":[{a_in}],"inputs":[{b_in}]}}', f'{{"inputs":[{b_in}]}}', "inputs"),
        "input data": (
            '{"inputs":[{"name":"features","shape":[1,8],"datatype":"FP32",'
            f'"data":{json.dumps(a)},"data":{json.dumps(b)}}}]}}',
            f'{{"inputs":[{b_in}]}}',
            "data",
        ),
        "top-level parameters": (
            f'{{"inputs":[{b_in}],"outputs":[{{"name":"label"}}],'
            '"parameters":{"binary_data_output":true,"binary_data_output":false}}',
            f'{{"inputs":[{b_in}],"outputs":[{{"name":"label"}}],"parameters":{{"binary_data_output":false}}}}',
            "binary_data_output",
        ),
    }


@pytest.mark.parametrize("case", ["top-level inputs", "input data", "top-level parameters"])
def test_duplicate_keys_cannot_poison_the_cache(one_triton, gw, case: str) -> None:
    seed = 10 + ["top-level inputs", "input data", "top-level parameters"].index(case)
    attacker, victim, key = _poison_cases(_row(seed), _row(seed + 100))[case]
    attacked = _post(gw.http, attacker.encode())
    status, headers, got = _post(gw.http, victim.encode())
    want_status, _, want = _post(_direct(one_triton), victim.encode())
    assert (status, want_status) == (200, 200)
    assert got == want  # byte for byte, so also in the same (JSON, not binary) encoding
    assert headers["x-skewserve-cache"] == "miss"  # nothing was filed under the victim's key
    assert attacked[0] == 400, attacked
    assert f"duplicate key {key!r}" in json.loads(attacked[2])["error"]


def test_duplicate_shape_cannot_pass_the_batch_limit(gw) -> None:
    # Triton reads the first shape, [16, 8], which is above the gateway's limit of 8.
    body = (
        '{"inputs":[{"name":"features","shape":[16,8],"shape":[1,8],"datatype":"FP32",'
        f'"data":{json.dumps(_row(20, rows=16))}}}]}}'
    )
    status, _, raw = _post(gw.http, body.encode(), model="lt_nocache")
    assert status == 400
    assert json.loads(raw)["error"].startswith("duplicate key 'shape' in inputs[0] of the request JSON")


# -- 4. malformed JSON --------------------------------------------------------------------------
DEEP = '{"inputs":[],"parameters":{"x":' + "[" * 2000 + "]" * 2000 + "}}"
MALFORMED: dict[str, tuple[bytes, dict[str, str], str]] = {
    "top-level array": (b"[1, 2]", {}, "the request JSON must be an object at the top level, got an array"),
    "top-level string": (b'"x"', {}, "the request JSON must be an object at the top level, got a string"),
    "top-level number": (b"7", {}, "the request JSON must be an object at the top level, got a number"),
    "inputs not a list": (b'{"inputs": {}}', {}, "inputs must be an array of objects, got an object"),
    "input not an object": (b'{"inputs": [5]}', {}, "inputs[0] must be an object, got a number"),
    "shape not a list": (
        b'{"inputs":[{"name":"features","shape":"1,8","datatype":"FP32","data":[]}]}',
        {},
        "inputs[0].shape must be an array of non-negative integers, got '1,8'",
    ),
    "shape of floats": (
        b'{"inputs":[{"name":"features","shape":[1.0,8],"datatype":"FP32","data":[]}]}',
        {},
        "inputs[0].shape must be an array of non-negative integers, got [1.0, 8]",
    ),
    "deep nesting": (DEEP.encode(), {}, "the request JSON nests"),
    "timeout a string": (
        b'{"inputs":[],"parameters":{"timeout":"5"}}',
        {},
        "parameters.timeout must be a non-negative integer of microseconds, got '5'",
    ),
    "timeout negative": (
        b'{"inputs":[],"parameters":{"timeout":-1}}',
        {},
        "parameters.timeout must be a non-negative integer of microseconds, got -1",
    ),
    "timeout a boolean": (
        b'{"inputs":[],"parameters":{"timeout":true}}',
        {},
        "parameters.timeout must be a non-negative integer of microseconds, got True",
    ),
    "header length negative": (
        b'{"inputs":[]}',
        {"Inference-Header-Content-Length": "-5"},
        "Inference-Header-Content-Length must not be negative, got '-5'",
    ),
    "header length past the body": (
        b'{"inputs":[]}',
        {"Inference-Header-Content-Length": "99"},
        "Inference-Header-Content-Length 99 exceeds the body size 13",
    ),
    "header length not decimal": (
        b'{"inputs":[]}',
        {"Inference-Header-Content-Length": "1_0"},
        "Inference-Header-Content-Length must be an integer, got '1_0'",
    ),
}


@pytest.mark.parametrize("model", ["lt", "lt_nocache"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_json_is_a_400_naming_the_field(gw, case: str, model: str) -> None:
    body, headers, message = MALFORMED[case]
    status, _, raw = _post(gw.http, body, model=model, headers=headers)
    assert status == 400, raw
    assert json.loads(raw)["error"].startswith(message)


def test_large_json_body_does_not_stall_other_requests(one_triton, gw) -> None:
    """While the gateway reads a ~9 MB JSON body, the event loop keeps serving other requests.

    The big request is refused by the batch limit after it is read, so it never reaches Triton:
    from the moment the gateway counts it in flight (its body received) until its 400 arrives,
    the gateway is only parsing. Other requests must be answered inside that window.
    """
    rows = 800_000
    big = json.dumps(
        {"inputs": [{"name": "features", "shape": [rows], "datatype": "BYTES", "data": ["abcdefgh"] * rows}]}
    ).encode()
    assert len(big) > 9_000_000
    small = f'{{"inputs":[{_input(_row(30))}]}}'.encode()
    # The probe is a cache hit, so its answer needs only the event loop, not Triton: a probe that
    # waited on Triton could lose the race to the big body's parse on a slow machine.
    _post(gw.http, small, model="lt")
    wait_until(
        lambda: _post(gw.http, small, model="lt")[1].get("x-skewserve-cache") == "hit", 10, "a cached probe"
    )

    def attempt() -> tuple[tuple[int, bytes], list[str]]:
        big_done = threading.Event()
        big_result: list[tuple[int, bytes]] = []

        def send_big() -> None:
            status, _, raw = _post(gw.http, big, model="lt")
            big_result.append((status, raw))
            big_done.set()

        sender = threading.Thread(target=send_big)
        sender.start()
        events: list[str] = []
        deadline = time.monotonic() + 120
        while not big_done.is_set() and time.monotonic() < deadline:
            if gw.admin()["inflight"] >= 1 and not big_done.is_set():
                events.append("big request in flight (body read)")
                status, headers, _ = _post(gw.http, small, model="lt")
                if status == 200 and headers.get("x-skewserve-cache") == "hit" and not big_done.is_set():
                    events.append("other request answered")
                    break
        sender.join(120)
        assert big_result, "the big request got no answer"
        return big_result[0], events

    # A parse that ends before the probe is sent proves nothing either way: try again, bounded.
    for _ in range(3):
        (status, raw), events = attempt()
        assert status == 400
        assert "above the gateway limit of 8" in json.loads(raw)["error"]
        if events[-1:] == ["other request answered"]:
            break
    assert events[-2:] == ["big request in flight (body read)", "other request answered"], events


# -- 5. compressed bodies -----------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_bodies_work_with_cache_and_batch_limit(one_triton, gw, algorithm: str) -> None:
    x = (np.random.default_rng(40 + len(algorithm)).standard_normal((4, 8)) * 10).astype(np.float32)

    def infer(address: str, compress: str | None) -> httpclient.InferResult:
        client = httpclient.InferenceServerClient(address)
        inp = httpclient.InferInput("features", [4, 8], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        return client.infer("lt", [inp], request_compression_algorithm=compress)

    want = infer(_direct(one_triton), None)
    hits_before = gw.admin()["cache"]["hits"]
    for _ in range(2):
        got = infer(gw.http, algorithm)
        for name in ("logits", "probabilities", "label"):
            np.testing.assert_array_equal(got.as_numpy(name), want.as_numpy(name))
    assert gw.admin()["cache"]["hits"] == hits_before + 1  # keyed on the inflated bytes


def test_zip_bomb_is_a_413_and_unknown_encodings_are_refused(one_triton, make_gateway) -> None:
    g = make_gateway(gateway_config(one_triton, limits={"max_request_bytes": 1_000_000}))
    bomb = gzip.compress(b'{"inputs":[' + b" " * 5_000_000 + b"]}")
    assert len(bomb) < 10_000
    status, _, raw = _post(g.http, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413
    assert json.loads(raw)["error"] == (
        "the gzip request body inflates to more than the limit of 1000000 bytes (limits.max_request_bytes)"
    )
    status, _, raw = _post(g.http, zlib.compress(b"{}")[:-3], headers={"Content-Encoding": "deflate"})
    assert (status, json.loads(raw)["error"]) == (400, "the deflate request body is truncated")
    status, _, raw = _post(g.http, b"{}", headers={"Content-Encoding": "br"})
    assert status == 415
    assert (
        json.loads(raw)["error"] == "Content-Encoding 'br' is not supported; send gzip, deflate or identity"
    )


# -- 11. slow uploads ---------------------------------------------------------------------------
def _interim(sock: socket.socket) -> bytes:
    """One interim response head ("100 Continue"), read byte by byte so nothing after it is lost."""
    data = b""
    while not data.endswith(b"\r\n\r\n") and len(data) < 256:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), body


def test_slow_uploads_hold_no_inflight_slot_and_time_out(one_triton, make_gateway) -> None:
    max_inflight = 2
    g = make_gateway(
        # The bound is far above the few milliseconds the trickle below takes, whatever the load:
        # the uploads are still pending while the normal requests are served.
        gateway_config(one_triton, limits={"max_inflight": max_inflight, "body_read_timeout_s": 15})
    )
    host, port = g.http.rsplit(":", 1)
    slow: list[socket.socket] = []
    try:
        # As many trickling uploads as the in-flight limit, each one inside the infer handler:
        # uvicorn answers "100 Continue" only once the handler asks for the body.
        for _ in range(max_inflight):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(
                b"POST /v2/models/lt_nocache/infer HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n"
            )
            assert _interim(s).startswith(b"HTTP/1.1 100 Continue")
            slow.append(s)
        body = f'{{"inputs":[{_input(_row(50))}]}}'.encode()
        want = _post(_direct(one_triton), body, model="lt_nocache")[2]
        for n in range(3):  # one byte at a time on every slow upload, a normal request in between
            for s in slow:
                s.sendall(b"{" if n == 0 else b" ")
            status, _, got = _post(g.http, body, model="lt_nocache")
            assert status == 200, got
            assert _outputs(got) == _outputs(want)
        for s in slow:
            status, raw = _read_response(s)
            assert status == 408
            assert json.loads(raw)["error"] == (
                "request body not received within 15 s (limits.body_read_timeout_s); "
                "send the body without pauses"
            )
            assert s.recv(1) == b""  # and the connection is closed, not left to trickle on
    finally:
        for s in slow:
            s.close()


# -- 8. the remaining deadline reaches Triton ---------------------------------------------------
def test_the_remaining_deadline_reaches_triton_as_its_timeout(one_triton, make_gateway) -> None:
    triton = one_triton["us-east"][0]
    relay = TcpRelay(triton.http_address)
    try:
        cfg = gateway_config(one_triton)
        cfg["regions"][0]["servers"][0]["http"] = relay.address  # infer over the relay, probes over gRPC
        g = make_gateway(cfg)
        x = np.random.default_rng(60).standard_normal((2, 8)).astype(np.float32)
        client = httpclient.InferenceServerClient(g.http)
        inp = httpclient.InferInput("features", [2, 8], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        got = client.infer("lt_nocache", [inp], headers={"x-skewserve-timeout-ms": "5000"})
        want = httpclient.InferenceServerClient(triton.http_address).infer("lt_nocache", [inp])
        np.testing.assert_array_equal(got.as_numpy("probabilities"), want.as_numpy("probabilities"))
        body = f'{{"inputs":[{_input(_row(61))}],"parameters":{{"timeout":4000000}}}}'.encode()
        status, _, raw = _post(g.http, gzip.compress(body), "lt_nocache", {"Content-Encoding": "gzip"})
        assert status == 200, raw
        binary, compressed = relay.infer_headers()
        assert 0 < binary["parameters"]["timeout"] <= 5_000_000  # the remaining deadline, in microseconds
        assert binary["inputs"][0]["parameters"] == {"binary_data_size": x.nbytes}
        # The client's timeout was the deadline: what remains of it, never more, reaches Triton.
        assert 0 < compressed["parameters"]["timeout"] <= 4_000_000
        assert compressed["inputs"] == json.loads(body)["inputs"]  # forwarded inflated
    finally:
        relay.close()


def test_bodies_being_received_are_bounded_in_bytes(one_triton, make_gateway) -> None:
    # One caller may hold all of it here: this test is about the worker's bound (per caller: below).
    limits = {
        "max_request_bytes": 150_000,
        "max_buffered_body_bytes": 200_000,
        "max_buffered_body_bytes_per_caller": 200_000,
    }
    g = make_gateway(gateway_config(one_triton, limits=limits))
    host, port = g.http.rsplit(":", 1)
    padded = f'{{"inputs":[{_input(_row(70))}]{" " * 100_000}}}'.encode()  # valid, ~100 KB
    small = f'{{"inputs":[{_input(_row(71))}]}}'.encode()
    slow = socket.create_connection((host, int(port)), timeout=30)
    try:
        slow.sendall(
            b"POST /v2/models/lt_nocache/infer HTTP/1.1\r\nHost: gw\r\nContent-Length: 150000\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        assert _interim(slow).startswith(b"HTTP/1.1 100 Continue")
        slow.sendall(b" " * 120_000)  # held: 120 KB of an unfinished body
        # Every byte of it counted before the next request: one still being read when the next one
        # is counted would be the request over the bound (refused, its bytes given back).
        wait_until(
            lambda: g.admin()["request_bytes"]["held"] == 120_000, what="the gateway to hold 120,000 bytes"
        )
        status, _, raw = _post(g.http, padded, model="lt_nocache")
        assert (status, json.loads(raw).get("error")) == (
            503,
            "the gateway holds more than 200000 bytes of requests at once "
            "(limits.max_buffered_body_bytes); retry later",
        ), raw
        assert _post(g.http, small, model="lt_nocache")[0] == 200  # small bodies still fit
    finally:
        slow.close()
    # The abandoned upload's bytes are given back once the gateway sees it go.
    wait_until(
        lambda: g.admin()["request_bytes"]["held"] == 0, what="the abandoned upload's bytes given back"
    )
    assert _post(g.http, padded, model="lt_nocache")[0] == 200


def test_a_keyless_gzip_body_is_refused_before_it_is_read_or_inflated(one_triton, make_gateway) -> None:
    """The 401 comes back while almost all of the compressed body is still unsent: the gateway
    answered from the headers, without reading the body, let alone inflating it."""
    from gateway.state.auth import hash_key

    g = make_gateway(
        gateway_config(one_triton, auth={"keys": [{"name": "k", "sha256": hash_key("sk-" + "k" * 30)}]})
    )
    bomb = gzip.compress(b'{"inputs":[' + b" " * 50_000_000 + b"]}")
    host, port = g.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v2/models/lt/infer HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: " + str(len(bomb)).encode() + b"\r\n\r\n" + bomb[:64]
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
