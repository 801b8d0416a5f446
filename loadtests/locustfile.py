"""Locust users for the skewserve gateway (or any Triton endpoint).

Run through `skewserve loadtest`, which sets the SKEWSERVE_LT_* variables (mix and shape) and picks
the user class for the protocol. Request names say protocol and model, e.g. `http-binary lt`.
"""

from __future__ import annotations

import json
import os
import time

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpcio's C core must cooperate with gevent before any channel exists

import tritonclient.grpc as grpcclient  # noqa: E402
from locust import FastHttpUser, LoadTestShape, User, constant, task  # noqa: E402

from loadtests.mix import MixSettings, RequestMix  # noqa: E402
from loadtests.shapes import ShapeParams, shape_tick  # noqa: E402

REGION_HEADER = os.environ.get("SKEWSERVE_LT_REGION_HEADER", "x-skewserve-region")


class _Mixed:
    def _mix(self) -> RequestMix:
        mix = getattr(self, "_request_mix", None)
        if mix is None:
            mix = self._request_mix = RequestMix(MixSettings.from_env())
        return mix


class HttpJsonUser(FastHttpUser, _Mixed):
    """KServe v2 JSON tensors over HTTP."""

    wait_time = constant(0)

    @task
    def infer(self) -> None:
        model, _, row, region = self._mix().draw()
        body = json.dumps(
            {
                "inputs": [
                    {
                        "name": "features",
                        "shape": list(row.shape),
                        "datatype": "FP32",
                        "data": row.ravel().tolist(),
                    }
                ]
            }
        )
        headers = {"Content-Type": "application/json"} | ({REGION_HEADER: region} if region else {})
        with self.client.post(
            f"/v2/models/{model}/infer",
            data=body,
            headers=headers,
            name=f"http-json {model}",
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")


class HttpBinaryUser(FastHttpUser, _Mixed):
    """Triton's binary tensor extension over HTTP (Inference-Header-Content-Length)."""

    wait_time = constant(0)

    @task
    def infer(self) -> None:
        model, _, row, region = self._mix().draw()
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "features",
                        "shape": list(row.shape),
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": row.nbytes},
                    }
                ],
                "outputs": [
                    {"name": "probabilities", "parameters": {"binary_data": True}},
                    {"name": "label", "parameters": {"binary_data": True}},
                ],
            }
        ).encode()
        headers = {
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        }
        if region:
            headers[REGION_HEADER] = region
        with self.client.post(
            f"/v2/models/{model}/infer",
            data=header + row.tobytes(),
            headers=headers,
            name=f"http-binary {model}",
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")


class GrpcUser(User, _Mixed):
    """tritonclient.grpc, timed and reported to locust's statistics."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.grpc = grpcclient.InferenceServerClient(self.host.removeprefix("grpc://"))

    def on_stop(self) -> None:
        self.grpc.close()

    @task
    def infer(self) -> None:
        model, _, row, region = self._mix().draw()
        inp = grpcclient.InferInput("features", list(row.shape), "FP32")
        inp.set_data_from_numpy(row)
        started = time.perf_counter()
        exc: Exception | None = None
        length = 0
        try:
            result = self.grpc.infer(model, [inp], headers={REGION_HEADER: region} if region else None)
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
            return shape_tick(_SHAPE, self.params, self.get_run_time())
