"""401 / 403 / 429 / 413 / 400 (batch) / 503 through a real gateway; keys never reach the logs."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.state.auth import hash_key
from tests.gateway.conftest import gateway_config, wait_until
from tests.gateway.relay import TcpRelay

ADMIN_KEY = "sk-admin-7f3a9c2e51"
LIMITED_KEY = "sk-limited-0b8d4e6f"
BODY = json.dumps(
    {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": [0.25] * 8}]}
).encode()


def _post(address: str, model: str, body: bytes = BODY, **headers: str) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://{address}/v2/models/{model}/infer", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.fixture()
def secured(fleet, make_gateway):
    auth = {
        "keys": [
            {"name": "admin", "sha256": hash_key(ADMIN_KEY)},
            {
                "name": "limited",
                "sha256": hash_key(LIMITED_KEY),
                "models": ["lt_nocache"],
                # one token, refilled in 1000 s: the second request is over the limit however slowly
                # this machine sends it
                "rate_per_s": 0.001,
                "burst": 1,
            },
        ]
    }
    return make_gateway(
        gateway_config(fleet, auth=auth, limits={"max_request_bytes": 2000, "max_batch_size": 2})
    )


def test_missing_and_wrong_keys_are_401(secured) -> None:
    status, _, body = _post(secured.http, "lt_nocache")
    assert status == 401 and "missing API key" in body["error"]
    status, _, body = _post(secured.http, "lt_nocache", authorization="Bearer sk-wrong")
    assert (status, body["error"]) == (401, "invalid API key")
    assert _post(secured.http, "lt_nocache", authorization=f"Bearer {ADMIN_KEY}")[0] == 200
    assert _post(secured.http, "lt_nocache", **{"x-api-key": ADMIN_KEY})[0] == 200
    client = grpcclient.InferenceServerClient(secured.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 8), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("lt_nocache", [inp])
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.infer("lt_nocache", [inp], headers={"authorization": f"Bearer {ADMIN_KEY}"}).as_numpy(
        "label"
    ).shape == (1, 1)


def test_model_outside_the_keys_list_is_403(secured) -> None:
    status, _, body = _post(secured.http, "lt", **{"x-api-key": LIMITED_KEY})
    assert (status, body["error"]) == (403, "API key 'limited' may not use model 'lt'")


def test_rate_limit_is_429_with_retry_after(secured) -> None:
    assert _post(secured.http, "lt_nocache", **{"x-api-key": LIMITED_KEY})[0] == 200
    status, headers, body = _post(secured.http, "lt_nocache", **{"x-api-key": LIMITED_KEY})
    assert status == 429 and "rate limit for API key 'limited' exceeded" in body["error"]
    assert int({k.lower(): v for k, v in headers.items()}["retry-after"]) >= 1


def test_too_large_is_413_and_too_big_a_batch_is_400(secured) -> None:
    big = json.dumps(
        {"inputs": [{"name": "features", "shape": [40, 8], "datatype": "FP32", "data": [0.25] * 320}]}
    ).encode()
    status, _, body = _post(secured.http, "lt_nocache", big, **{"x-api-key": ADMIN_KEY})
    assert status == 413 and "exceeds the limit of 2000" in body["error"]
    batch = json.dumps(
        {"inputs": [{"name": "features", "shape": [3, 8], "datatype": "FP32", "data": [0.25] * 24}]}
    ).encode()
    status, _, body = _post(secured.http, "lt_nocache", batch, **{"x-api-key": ADMIN_KEY})
    assert (status, body["error"]) == (400, "input 'features' has batch size 3, above the gateway limit of 2")


def test_keys_never_appear_in_logs(secured) -> None:
    _post(secured.http, "lt", **{"x-api-key": LIMITED_KEY})
    _post(secured.http, "lt_nocache", authorization=f"Bearer {ADMIN_KEY}")
    _post(secured.http, "lt_nocache", authorization="Bearer sk-wrong-secret-value")
    log = secured.log_path.read_text()
    for secret in (ADMIN_KEY, LIMITED_KEY, "sk-wrong-secret-value"):
        assert secret not in log


def test_global_inflight_limit_sheds_with_503(fleet, make_gateway) -> None:
    # Hold one request in flight upstream: a relay in front of the only server forwards nothing
    # until released. (A slow upload holds no slot: the gateway reads the body before admitting.)
    triton = fleet["us-east"][0]
    relay = TcpRelay(triton.http_address, hold=True)
    cfg = gateway_config(fleet, limits={"max_inflight": 1})
    cfg["regions"] = [
        {
            "name": "us-east",
            "servers": [{"name": triton.spec.name, "http": relay.address, "grpc": triton.grpc_address}],
        }
    ]
    gw = make_gateway(cfg)
    held: list[int] = []
    holder = threading.Thread(target=lambda: held.append(_post(gw.http, "lt_nocache")[0]))
    holder.start()
    try:
        wait_until(lambda: gw.admin()["inflight"] == 1, what="the held request to be in flight")
        status, _, body = _post(gw.http, "lt_nocache")
        assert status == 503 and body["error"] == "gateway is at its in-flight limit (1); retry later"
        relay.release()
        holder.join(30)
        assert held == [200]
    finally:
        relay.close()
    assert _post(gw.http, "lt_nocache")[0] == 200
