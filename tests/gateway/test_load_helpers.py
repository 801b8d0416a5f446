"""The load generators behind "zero failed requests" count every bad answer as a failure (issue 22, 7).

They run against a real HTTP server that misbehaves the way a broken proxy would: a body cut short
of its Content-Length (http.client's IncompleteRead), or a whole body that is not a full answer.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from tests.gateway.steady_load import SteadyLoad
from tests.waiting import wait_until

GOOD = json.dumps(
    {"outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [2, 3], "data": [0.1] * 6}]}
).encode()
PARTIAL = json.dumps(
    {"outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [2, 3], "data": [0.1] * 3}]}
).encode()


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    mode = "good"

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = PARTIAL if self.server.mode == "partial" else GOOD  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("x-skewserve-server", "s0")
        if self.server.mode == "truncated":  # type: ignore[attr-defined]
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def upstream() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    server.mode = "good"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode", ["truncated", "partial"])
def test_steady_load_counts_truncated_and_partial_answers_as_failures(
    upstream: http.server.ThreadingHTTPServer, mode: str
) -> None:
    load = SteadyLoad(f"127.0.0.1:{upstream.server_address[1]}", threads=2).start()
    try:
        wait_until(lambda: load.ok >= 5, 30, "good answers counted")
        upstream.mode = mode  # type: ignore[attr-defined]
        wait_until(lambda: len(load.failed) >= 5, 30, f"{mode} answers counted as failures")
        upstream.mode = "good"  # type: ignore[attr-defined]
        served = load.ok
        wait_until(lambda: load.ok >= served + 5, 30, "the client threads are still sending")
        assert all(t.is_alive() for t in load.threads)
    finally:
        load.stop()
    expected = "IncompleteRead" if mode == "truncated" else "values for 2 rows"
    assert any(expected in f for f in load.failed), load.failed[:3]
