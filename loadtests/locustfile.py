"""Locust users for the skewserve gateway (or any Triton endpoint).

Run through `skewserve loadtest`, which sets the SKEWSERVE_LT_* variables (mix and shape) and picks
the user class for the protocol. Request names say protocol and model, e.g. `http-binary lt`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpcio's C core must cooperate with gevent before any channel exists

import tritonclient.grpc as grpcclient  # noqa: E402
from locust import FastHttpUser, LoadTestShape, User, constant, task  # noqa: E402

from loadtests.mix import MixSettings, RequestMix  # noqa: E402
from loadtests.shapes import ShapeParams, shape_tick  # noqa: E402
from loadtests.wire import binary_request, json_request  # noqa: E402

REGION_HEADER = os.environ.get("SKEWSERVE_LT_REGION_HEADER", "x-skewserve-region")
# The gateway's API key (`skewserve loadtest` passes it through the environment, never argv).
KEY_HEADERS = {"x-api-key": os.environ["SKEWSERVE_API_KEY"]} if os.environ.get("SKEWSERVE_API_KEY") else {}


class _Mixed:
    def _mix(self) -> RequestMix:
        mix = getattr(self, "_request_mix", None)
        if mix is None:
            mix = self._request_mix = RequestMix(MixSettings.from_env())
        return mix


class _HttpUser(FastHttpUser, _Mixed):
    abstract = True
    wait_time = constant(0)
    kind = ""

    def encode(self, row: Any) -> tuple[bytes, dict[str, str]]:
        raise NotImplementedError

    @task
    def infer(self) -> None:
        mix = self._mix()
        model, _, row, region = mix.draw()
        body, headers = self.encode(mix.tensors(row))
        headers.update(KEY_HEADERS)
        if region:
            headers[REGION_HEADER] = region
        with self.client.post(
            f"/v2/models/{model}/infer",
            data=body,
            headers=headers,
            name=f"{self.kind} {model}",
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")


class HttpJsonUser(_HttpUser):
    """KServe v2 JSON tensors over HTTP."""

    kind = "http-json"

    def encode(self, row: Any) -> tuple[bytes, dict[str, str]]:
        return json_request(row)


class HttpBinaryUser(_HttpUser):
    """Triton's binary tensor extension over HTTP (Inference-Header-Content-Length)."""

    kind = "http-binary"

    def encode(self, row: Any) -> tuple[bytes, dict[str, str]]:
        return binary_request(row)


class GrpcUser(User, _Mixed):
    """tritonclient.grpc, timed and reported to locust's statistics."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.grpc = grpcclient.InferenceServerClient(self.host.removeprefix("grpc://"))

    def on_stop(self) -> None:
        self.grpc.close()

    @task
    def infer(self) -> None:
        mix = self._mix()
        model, _, row, region = mix.draw()
        inputs = []
        for name, datatype, x in mix.tensors(row):
            inp = grpcclient.InferInput(name, list(x.shape), datatype)
            inp.set_data_from_numpy(x)
            inputs.append(inp)
        started = time.perf_counter()
        exc: Exception | None = None
        length = 0
        try:
            headers = dict(KEY_HEADERS) | ({REGION_HEADER: region} if region else {})
            result = self.grpc.infer(model, inputs, headers=headers or None)
            length = result.get_response().ByteSize()
        except Exception as e:  # reported to locust as a failure, never swallowed
            exc = e
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"grpc {model}",
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=exc,
            context={},
        )


# loadtest --requests: the run ends (as at its duration) once this many requests were answered.
_MAX_REQUESTS = int(os.environ.get("SKEWSERVE_LT_MAX_REQUESTS") or 0)


_SHAPE = os.environ.get("SKEWSERVE_LT_SHAPE", "")
if _SHAPE:

    class SkewShape(LoadTestShape):
        """The shape named by SKEWSERVE_LT_SHAPE, with users / spawn rate / duration from the environment."""

        params = ShapeParams(
            users=int(os.environ.get("SKEWSERVE_LT_USERS", "4")),
            spawn_rate=float(os.environ.get("SKEWSERVE_LT_SPAWN_RATE", "4")),
            duration_s=float(os.environ.get("SKEWSERVE_LT_DURATION_S", "10")),
        )

        def tick(self) -> tuple[int, float] | None:
            if (
                _MAX_REQUESTS
                and self.runner is not None
                and self.runner.stats.total.num_requests >= _MAX_REQUESTS
            ):
                return None
            return shape_tick(_SHAPE, self.params, self.get_run_time())
