"""Client load for fleet-change tests: threads sending infer requests, counting answers per server."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from collections import Counter
from typing import Any

BODY = json.dumps(
    {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 8], "data": [0.5] * 16}]}
).encode()


def check_infer_answer(body: bytes, rows: int) -> None:
    """Raise unless `body` is a whole KServe v2 answer for `rows` items: truncated or partial answers
    count as failures, not as served requests."""
    answer: dict[str, Any] = json.loads(body)
    outputs = answer.get("outputs")
    if not outputs:
        raise ValueError(f"answer without outputs: {body[:200]!r}")
    for out in outputs:
        shape, data = out["shape"], out["data"]
        if shape[0] != rows or len(data) != math.prod(shape):
            raise ValueError(f"output {out['name']}: shape {shape} with {len(data)} values for {rows} rows")


class SteadyLoad:
    """`threads` clients in a loop until stopped; every failure is recorded, none ignored."""

    def __init__(self, http: str, threads: int = 4, model: str = "lt") -> None:
        self.url = f"http://{http}/v2/models/{model}/infer"
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.by_server: Counter[str] = Counter()
        self.failed: list[str] = []
        self.log: list[tuple[float, str]] = []  # (when the request was sent, server that answered)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    @property
    def ok(self) -> int:
        with self.lock:
            return sum(self.by_server.values())

    def served(self, server: str) -> int:
        with self.lock:
            return self.by_server[server]

    def served_since(self, server: str, t: float) -> int:
        """Requests sent at or after `t` (time.monotonic) that `server` answered."""
        with self.lock:
            return sum(1 for sent, s in self.log if sent >= t and s == server)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            sent = time.monotonic()
            req = urllib.request.Request(self.url, data=BODY, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    check_infer_answer(r.read(), rows=2)
                    server = r.headers.get("x-skewserve-server", "")
                with self.lock:
                    self.by_server[server] += 1
                    self.log.append((sent, server))
            # Anything at all (a truncated body's IncompleteRead, a malformed answer) is a failure
            # that the test sees; the thread goes on sending.
            except Exception as exc:
                with self.lock:
                    self.failed.append(repr(exc))

    def start(self) -> SteadyLoad:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            if t.is_alive():
                t.join(30)
