"""A client cannot tell the gateway from Triton: same results, same errors, same metadata."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.waiting import wait_until

X = (np.random.default_rng(5).standard_normal((4, 8)) * 15).astype(np.float32)


def _http_infer(address: str, model: str, binary: bool, x: np.ndarray = X, **kw):
    client = httpclient.InferenceServerClient(address)
    inp = httpclient.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [
        httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "probabilities", "label")
    ]
    return client.infer(model, [inp], outputs=outs, **kw)


def _grpc_infer(address: str, model: str, x: np.ndarray = X, **kw):
    client = grpcclient.InferenceServerClient(address)
    inp = grpcclient.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], **kw)


@pytest.mark.parametrize("model", ["lt", "lt_nocache"])
def test_results_equal_direct_for_http_json_binary_and_grpc(fleet, shared_gateway, model: str) -> None:
    direct = fleet["us-east"][0]
    for binary in (False, True):
        want = _http_infer(direct.http_address, model, binary)
        got = _http_infer(shared_gateway.http, model, binary)
        for name in ("logits", "probabilities", "label"):
            np.testing.assert_array_equal(got.as_numpy(name), want.as_numpy(name))
        assert got.get_response()["model_name"] == model and got.get_response()["model_version"] == "1"
    want_g = _grpc_infer(direct.grpc_address, model)
    got_g = _grpc_infer(shared_gateway.grpc, model)
    for name in ("logits", "probabilities", "label"):
        np.testing.assert_array_equal(got_g.as_numpy(name), want_g.as_numpy(name))


def _http_error(address: str, body: dict, model: str = "lt") -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://{address}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    raise AssertionError("expected an error")


BAD_REQUESTS = {
    "unknown model": (
        {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}]},
        "nope",
    ),
    "bad shape": (
        {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [0.0] * 3}]},
        "lt_nocache",
    ),
    "bad datatype": (
        {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "INT32", "data": [0] * 8}]},
        "lt_nocache",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_http_error_parity_with_triton(fleet, shared_gateway, case: str) -> None:
    body, model = BAD_REQUESTS[case]
    assert _http_error(shared_gateway.http, body, model) == _http_error(
        fleet["us-east"][0].http_address, body, model
    )


def test_grpc_error_parity_with_triton(fleet, shared_gateway) -> None:
    def err(address: str, model: str, x: np.ndarray) -> tuple[str, str]:
        with pytest.raises(InferenceServerException) as info:
            _grpc_infer(address, model, x)
        return info.value.status(), info.value.message()

    direct = fleet["us-east"][0].grpc_address
    for model, x in (("nope", X), ("lt_nocache", X[:, :3].copy()), ("lt_nocache", X.astype(np.float64))):
        assert err(shared_gateway.grpc, model, x) == err(direct, model, x)


def test_metadata_config_and_readiness_match_triton(fleet, shared_gateway) -> None:
    direct = httpclient.InferenceServerClient(fleet["us-east"][0].http_address)
    gw = httpclient.InferenceServerClient(shared_gateway.http)
    assert gw.get_model_metadata("lt") == direct.get_model_metadata("lt")
    assert gw.get_model_config("lt") == direct.get_model_config("lt")
    assert gw.get_model_metadata("lt", "1") == direct.get_model_metadata("lt", "1")
    assert gw.is_model_ready("lt") and gw.is_server_live() and gw.is_server_ready()
    meta = gw.get_server_metadata()
    assert meta["name"] in {"us-east-us-east-0", "us-east-us-east-1"}  # proxied from a home-region Triton
    assert meta["extensions"] == direct.get_server_metadata()["extensions"]
    g_direct = grpcclient.InferenceServerClient(fleet["us-east"][0].grpc_address)
    g_gw = grpcclient.InferenceServerClient(shared_gateway.grpc)
    assert g_gw.get_model_metadata("lt") == g_direct.get_model_metadata("lt")
    assert g_gw.get_model_config("lt") == g_direct.get_model_config("lt")
    assert g_gw.is_model_ready("lt") and g_gw.is_server_live() and g_gw.is_server_ready()
    assert not g_gw.is_model_ready("nope") and not gw.is_model_ready("nope")


def test_classification_extension_through_gateway(fleet, shared_gateway) -> None:
    for address in (shared_gateway.http, fleet["us-east"][0].http_address):
        client = httpclient.InferenceServerClient(address)
        inp = httpclient.InferInput("features", list(X.shape), "FP32")
        inp.set_data_from_numpy(X)
        out = client.infer(
            "lt_nocache", [inp], outputs=[httpclient.InferRequestedOutput("probabilities", class_count=1)]
        )
        labels = [row[0].decode().split(":")[2] for row in out.as_numpy("probabilities")]
        assert all(label.startswith("class_") for label in labels)


def test_repository_and_admin_apis_of_triton_are_not_reachable(shared_gateway) -> None:
    for method, path in (
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models/lt/load"),
        ("POST", "/v2/repository/models/lt/unload"),
        ("GET", "/v2/systemsharedmemory/status"),
        ("GET", "/v2/cudasharedmemory/status"),
        ("GET", "/v2/trace/setting"),
        ("GET", "/v2/logging"),
    ):
        req = urllib.request.Request(
            f"http://{shared_gateway.http}{path}", data=b"{}" if method == "POST" else None, method=method
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 404
        assert "is not served by the gateway" in json.loads(info.value.read())["error"]
    client = grpcclient.InferenceServerClient(shared_gateway.grpc)
    for call in (
        client.get_model_repository_index,
        lambda: client.load_model("lt"),
        lambda: client.unload_model("lt"),
        client.get_system_shared_memory_status,
        client.get_trace_settings,
        client.get_log_settings,
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.UNIMPLEMENTED"


def test_request_id_is_passed_through_or_generated(shared_gateway) -> None:
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
    ).encode()
    req = urllib.request.Request(
        f"http://{shared_gateway.http}/v2/models/lt_nocache/infer",
        data=body,
        headers={"x-request-id": "abc-123"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["x-request-id"] == "abc-123"
        assert r.headers["x-skewserve-region"] == "us-east"
    with urllib.request.urlopen(urllib.request.Request(req.full_url, data=body), timeout=10) as r:
        assert len(r.headers["x-request-id"]) == 16
    channel = grpc.insecure_channel(shared_gateway.grpc)
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="lt_nocache", id="req-7")
    t = request.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    request.raw_input_contents.append(np.zeros((1, 8), np.float32).tobytes())
    del t
    response, call = stub.ModelInfer.with_call(request, metadata=(("x-request-id", "trace-9"),))
    assert response.id == "req-7"
    assert dict(call.trailing_metadata())["x-request-id"] == "trace-9"


def _inferences_by_server(fleet, model: str) -> dict[str, int]:
    """What each Triton server itself counted for `model` (its statistics extension)."""
    counts = {}
    for servers in fleet.values():
        for s in servers:
            with urllib.request.urlopen(f"{s.http_url}/v2/models/{model}/stats", timeout=10) as r:
                counts[s.spec.name] = json.loads(r.read())["model_stats"][0]["inference_count"]
    return counts


def _settled_inferences(fleet, model: str) -> dict[str, int]:
    """The counts once Triton has booked every answered request: it updates its statistics just
    after sending an answer, so an earlier test's last request can still land (seen in a full run)."""
    last = _inferences_by_server(fleet, model)
    for _ in range(100):
        now = _inferences_by_server(fleet, model)
        if now == last:
            return now
        last = now
    raise AssertionError(f"Triton's statistics kept changing: {last}")


def test_region_pin_is_honoured(shared_gateway, fleet) -> None:
    """A pinned request executes on a server of that region: Triton's own counters say so."""
    for region in ("eu-west", "us-east"):
        in_region = {s.spec.name for s in fleet[region]}
        before = _settled_inferences(fleet, "lt_nocache")
        res = _http_infer(shared_gateway.http, "lt_nocache", True, headers={"x-skewserve-region": region})
        assert res.get_response()["model_name"] == "lt_nocache"
        body = json.dumps(
            {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.1] * 8}]}
        ).encode()
        req = urllib.request.Request(
            f"http://{shared_gateway.http}/v2/models/lt_nocache/infer",
            data=body,
            headers={"x-skewserve-region": region},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["x-skewserve-region"] == region
            assert r.headers["x-skewserve-server"] in in_region
        _grpc_infer(shared_gateway.grpc, "lt_nocache", headers={"x-skewserve-region": region})
        expected = len(X) + 1 + len(X)  # items, as Triton counts
        target = sum(before.values()) + expected
        wait_until(
            lambda t=target: sum(_inferences_by_server(fleet, "lt_nocache").values()) >= t,
            30,
            "Triton to book the pinned requests",
        )
        after = _settled_inferences(fleet, "lt_nocache")
        grew = {name for name in after if after[name] > before[name]}
        assert grew and grew <= in_region, (region, before, after)
        assert sum(after.values()) - sum(before.values()) == expected
    with pytest.raises(InferenceServerException, match="pinned region 'mars' does not exist"):
        _grpc_infer(shared_gateway.grpc, "lt_nocache", headers={"x-skewserve-region": "mars"})


def test_metrics_are_exported(shared_gateway) -> None:
    _http_infer(shared_gateway.http, "lt_nocache", True)
    text = shared_gateway.metrics()
    for name in (
        "skewserve_gateway_requests_total",
        "skewserve_gateway_request_seconds_bucket",
        "skewserve_gateway_upstream_seconds",
        "skewserve_gateway_region_skew_index",
        "skewserve_gateway_upstream_inflight",
        "skewserve_gateway_cache_bytes",
    ):
        assert name in text, name
    assert 'model="lt_nocache",protocol="http",region="us-east"' in text


def test_http_health_probes_when_configured(fleet, make_gateway) -> None:
    from tests.gateway.conftest import gateway_config

    gw = make_gateway(gateway_config(fleet, upstream_protocol="http"))
    state = gw.admin()
    assert all(s["available"] and s["models"].get("lt") == ["1"] for s in state["servers"])
    assert _http_infer(gw.http, "lt_nocache", True).as_numpy("label").shape == (4, 1)
    assert _grpc_infer(gw.grpc, "lt_nocache").as_numpy("label").shape == (4, 1)


def test_malformed_binary_header_length_is_a_400(shared_gateway) -> None:
    req = urllib.request.Request(
        f"http://{shared_gateway.http}/v2/models/lt_nocache/infer",
        data=b"{}",
        headers={"Inference-Header-Content-Length": "ten"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    assert info.value.code == 400
    assert (
        json.loads(info.value.read())["error"]
        == "Inference-Header-Content-Length must be an integer, got 'ten'"
    )


def test_an_invalid_region_pin_is_refused_even_when_the_answer_is_cached(shared_gateway) -> None:
    """Issue 25 item 6: the pin is validated before the cache, on both fronts."""
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.25] * 8}]}
    ).encode()
    url = f"http://{shared_gateway.http}/v2/models/lt/infer"
    for _ in range(2):  # the second is a cache hit
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as r:
            assert r.status == 200
    pinned = urllib.request.Request(url, data=body, headers={"x-skewserve-region": "mars"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(pinned, timeout=10)
    assert err.value.code == 400
    assert "pinned region 'mars' does not exist" in err.value.read().decode()
    _grpc_infer(shared_gateway.grpc, "lt")
    _grpc_infer(shared_gateway.grpc, "lt")
    with pytest.raises(InferenceServerException, match="pinned region 'mars' does not exist"):
        _grpc_infer(shared_gateway.grpc, "lt", headers={"x-skewserve-region": "mars"})
