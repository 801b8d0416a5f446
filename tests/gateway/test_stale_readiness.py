"""A model unloaded on a server between two health probes (an eviction, a rollback): requests that
reach that server in the gap are retried on a server that holds the model, never failed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.gateway.conftest import gateway_config, start_fleet, stop_fleet


def test_requests_in_the_gap_after_an_unload_go_to_a_server_that_holds_the_model(
    gateway_repo: Path, tmp_path: Path, prepared_triton, make_gateway
) -> None:
    fleet = start_fleet(
        gateway_repo,
        {"us-east": 2},
        tmp_path / "logs",
        prepared_triton,
        model_control_mode="explicit",
        load_models=("lt_nocache",),
    )
    try:
        # probes far apart: the gateway still believes both servers hold the model after the unload
        gw = make_gateway(
            gateway_config(fleet, health={"interval_s": 600, "timeout_s": 10}, cache={"models": []})
        )
        assert all("lt_nocache" in s["models"] for s in gw.admin()["servers"])
        # a client whose bad request makes Triton's error repeat "unknown model" (its request id)
        # changes nothing for anyone: the servers are asked before a model is forgotten
        hostile = json.dumps(
            {
                "id": "Request for unknown model: 'lt_nocache'",
                "inputs": [{"name": "nope", "shape": [1], "datatype": "FP32", "data": [0]}],
            }
        ).encode()
        for _ in range(4):
            req = urllib.request.Request(f"http://{gw.http}/v2/models/lt_nocache/infer", hostile)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=10)
            assert refused.value.code == 400
        assert all("lt_nocache" in s["models"] for s in gw.admin()["servers"])
        gone = fleet["us-east"][0]
        httpclient.InferenceServerClient(gone.http_address).unload_model("lt_nocache")
        x = np.zeros((2, 8), np.float32)
        http = httpclient.InferenceServerClient(gw.http)
        grpc = grpcclient.InferenceServerClient(gw.grpc)
        for _ in range(6):
            inp = httpclient.InferInput("features", [2, 8], "FP32")
            inp.set_data_from_numpy(x)
            assert http.infer("lt_nocache", [inp]).as_numpy("label").shape == (2, 1)
            ginp = grpcclient.InferInput("features", [2, 8], "FP32")
            ginp.set_data_from_numpy(x)
            assert grpc.infer("lt_nocache", [ginp]).as_numpy("label").shape == (2, 1)
        assert "lt_nocache" not in gw.server(gone.spec.name)["models"]  # forgotten there, not ejected
        assert gw.server(gone.spec.name)["ejections"] == 0
    finally:
        stop_fleet(fleet)
