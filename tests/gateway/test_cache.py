"""Response cache through real gateways: hit/miss, TTL, versions, Redis sharing and integrity, coalescing."""

from __future__ import annotations

import asyncio
import shutil
import threading
import urllib.request
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from exporter.pipeline import export_artifact
from gateway.state.cache import MemoryCache
from repository.desired_state import DesiredState
from repository.disk_store import DiskStateStore
from tests.gateway.conftest import gateway_config, start_fleet, stop_fleet, wait_until

SECRET = "0123456789abcdef-test-secret"


def _infer(address: str, x: np.ndarray, model: str = "lt") -> tuple[httpclient.InferResult, str | None]:
    body_x = x.astype(np.float32)
    client = httpclient.InferenceServerClient(address)
    inp = httpclient.InferInput("features", list(body_x.shape), "FP32")
    inp.set_data_from_numpy(body_x, binary_data=True)
    result = client.infer(model, [inp])
    # tritonclient hides response headers; ask again with urllib for the cache header
    return result, None


def _cache_header(
    address: str, x: np.ndarray, model: str = "lt", request_id: str | None = None
) -> tuple[str | None, dict]:
    import json

    body: dict = {
        "inputs": [
            {"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    if request_id:
        body["id"] = request_id
    req = urllib.request.Request(f"http://{address}/v2/models/{model}/infer", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers.get("x-skewserve-cache"), json.loads(r.read())


def _row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)


def test_hit_miss_and_shared_responses_carry_their_own_id(shared_gateway) -> None:
    x = _row(100)
    state1, body1 = _cache_header(shared_gateway.http, x, request_id="first")
    state2, body2 = _cache_header(shared_gateway.http, x, request_id="second")
    state3, body3 = _cache_header(shared_gateway.http, x)
    assert (state1, state2, state3) == ("miss", "hit", "hit")
    assert body1["id"] == "first" and body2["id"] == "second" and "id" not in body3
    assert body1["outputs"] == body2["outputs"] == body3["outputs"]
    assert _cache_header(shared_gateway.http, _row(101))[0] == "miss"
    assert _cache_header(shared_gateway.http, x, model="lt_nocache")[0] is None  # not opted in
    g = grpcclient.InferenceServerClient(shared_gateway.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(_row(102))
    first = g.infer("lt", [inp], request_id="g1")
    second = g.infer("lt", [inp], request_id="g2")
    assert second.get_response().id == "g2" and first.get_response().id == "g1"
    np.testing.assert_array_equal(first.as_numpy("probabilities"), second.as_numpy("probabilities"))
    hits = shared_gateway.admin()["cache"]["hits"]
    assert hits >= 3


def test_clients_asking_for_gzip_share_entries_with_everyone(shared_gateway) -> None:
    import json

    x = _row(150)
    body = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()
    states = []
    for _ in range(2):
        req = urllib.request.Request(
            f"http://{shared_gateway.http}/v2/models/lt/infer", data=body, headers={"Accept-Encoding": "gzip"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            states.append(r.headers["x-skewserve-cache"])
            assert json.loads(r.read())["model_name"] == "lt"
    assert states == ["miss", "hit"]
    assert _cache_header(shared_gateway.http, x)[0] == "hit"


def test_errors_are_never_cached(shared_gateway) -> None:
    import json

    bad = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [0.0] * 3}]}
    ).encode()
    before = shared_gateway.admin()["cache_bytes"]
    for _ in range(2):
        req = urllib.request.Request(f"http://{shared_gateway.http}/v2/models/lt/infer", data=bad)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 400 and info.value.headers.get("x-skewserve-cache") == "miss"
    assert shared_gateway.admin()["cache_bytes"] == before


def test_ttl_expires_entries(fleet, make_gateway) -> None:
    """The configured TTL reaches the gateway's cache: a cached answer expires by itself.

    Observed as a sequence, not timed: the first request misses, later ones hit, and, with no
    other writer of that key, a miss after a hit can only be the TTL expiring (hits do not
    refresh an entry). The exact window is checked with an injected clock below.
    """
    gw = make_gateway(gateway_config(fleet, cache={"ttl_s": 0.5}))
    x = _row(200)
    states = [_cache_header(gw.http, x)[0]]
    assert states == ["miss"]

    def expired_after_a_hit() -> bool:
        states.append(_cache_header(gw.http, x)[0])
        return "hit" in states and states[-1] == "miss"

    wait_until(expired_after_a_hit, timeout=30, what="a cached entry to expire after its TTL")
    assert set(states) == {"hit", "miss"}


def test_ttl_window_with_an_injected_clock() -> None:
    now = [100.0]
    cache = MemoryCache(max_bytes=1000, ttl_s=0.5, clock=lambda: now[0])

    async def run() -> list[bytes | None]:
        await cache.set("k", b"v")
        seen = []
        for t in (100.0, 100.499, 100.5):
            now[0] = t
            seen.append(await cache.get("k"))
        return seen

    # An entry lives exactly ttl_s: served up to just before, gone at the boundary.
    assert asyncio.run(run()) == [b"v", b"v", None]


def _success_count(fleet, model: str) -> int:
    total = 0
    for servers in fleet.values():
        for s in servers:
            stats = httpclient.InferenceServerClient(s.http_address).get_inference_statistics(model)
            total += sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])
    return total


def test_identical_concurrent_requests_reach_triton_once(fleet, make_gateway) -> None:
    gw = make_gateway(gateway_config(fleet))
    x = _row(300)
    before = _success_count(fleet, "lt")
    n = 16
    barrier = threading.Barrier(n)
    results: list[np.ndarray] = []
    errors: list[str] = []

    def one() -> None:
        client = grpcclient.InferenceServerClient(gw.grpc)
        inp = grpcclient.InferInput("features", [1, 8], "FP32")
        inp.set_data_from_numpy(x)
        barrier.wait()
        try:
            results.append(client.infer("lt", [inp]).as_numpy("probabilities"))
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == n
    assert all(np.array_equal(r, results[0]) for r in results)
    # Triton books an answer just after sending it: wait for the one, then check it is the only one
    wait_until(lambda: _success_count(fleet, "lt") - before >= 1, 30, "Triton to book the one inference")
    assert _success_count(fleet, "lt") - before == 1
    text = gw.metrics()
    hits = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('skewserve_gateway_cache_requests_total{model="lt",result="hit"}')
    )
    coalesced = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('skewserve_gateway_coalesced_requests_total{model="lt"}')
    )
    assert hits + coalesced == n - 1


def test_redis_is_shared_by_two_gateways_and_tampering_is_rejected(
    fleet, make_gateway, redis_url: str
) -> None:
    cache = {
        "backend": "redis",
        "redis_url": redis_url,
        "hmac_secret": SECRET,
        "namespace": "t1",
        "redis_timeout_s": 5.0,  # a slow lookup on a loaded CI machine would read as a miss
    }
    gw1 = make_gateway(gateway_config(fleet, cache=cache))
    gw2 = make_gateway(gateway_config(fleet, cache=cache))
    x = _row(400)
    state, body = _cache_header(gw1.http, x)
    assert state == "miss"
    client = redis.Redis.from_url(redis_url)
    wait_until(lambda: len(client.keys("t1:*")) == 1, 10, "the background write to redis")
    state2, body2 = _cache_header(gw2.http, x)
    assert state2 == "hit" and body2["outputs"] == body["outputs"]

    keys = client.keys("t1:*")
    assert len(keys) == 1
    raw = bytearray(client.get(keys[0]))
    raw[-3] ^= 0x01  # flip one bit of the stored response
    client.set(keys[0], bytes(raw))
    state3, body3 = _cache_header(gw2.http, x)
    assert state3 == "miss" and body3["outputs"] == body["outputs"]
    assert "skewserve_gateway_cache_integrity_failures_total 1.0" in gw2.metrics()
    wait_until(lambda: client.get(keys[0]) not in (None, bytes(raw)), 10, "the entry to be re-stored")
    assert _cache_header(gw1.http, x)[0] == "hit"  # re-stored intact after the miss


def test_a_gateway_without_the_redis_password_is_refused_and_serves_from_triton(
    fleet, make_gateway, redis_url: str
) -> None:
    """The tests' Redis requires a password, as deployed: a gateway given the URL without it is
    refused by Redis (nothing stored under its namespace) and fails open to Triton."""
    url_without_password = "redis://" + redis_url.split("@", 1)[1]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url_without_password).ping()
    cache = {"backend": "redis", "hmac_secret": SECRET, "namespace": "nopass"}
    keyless = make_gateway(gateway_config(fleet, cache={**cache, "redis_url": url_without_password}))
    keyed = make_gateway(
        gateway_config(fleet, cache={**cache, "namespace": "withpass", "redis_url": redis_url})
    )
    client = redis.Redis.from_url(redis_url)
    for gw, x in ((keyless, _row(401)), (keyed, _row(402))):
        for _ in range(2):
            state, body = _cache_header(gw.http, x)
            assert len(body["outputs"]) > 0
    wait_until(lambda: len(client.keys("withpass:*")) == 1, 10, "the keyed gateway's write to redis")
    assert client.keys("nopass:*") == []
    assert _cache_header(keyless.http, _row(401))[0] == "miss"  # never a hit: Redis never took an entry


@pytest.mark.slow
def test_new_model_version_is_never_served_a_stale_entry(
    gateway_repo: Path, small_artifact: Path, tmp_path: Path, prepared_triton, make_gateway
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(gateway_repo / "lt", repo / "lt")
    fleet = start_fleet(
        repo,
        {"us-east": 1},
        tmp_path / "logs",
        prepared_triton,
        model_control_mode="explicit",
        load_models=("lt",),
    )
    try:
        gw = make_gateway(gateway_config(fleet))
        x = _row(500)
        assert _cache_header(gw.http, x)[0] == "miss"
        state, body = _cache_header(gw.http, x)
        assert state == "hit" and body["model_version"] == "1"
        export_artifact(small_artifact, repo, "lt", tensorrt="off")
        # promoted as a rollout would (controller/), then loaded: the configs now name version 2
        DiskStateStore(repo).update("lt", partial(DesiredState.promote, version=2))
        httpclient.InferenceServerClient(fleet["us-east"][0].http_address).load_model("lt")
        wait_until(
            lambda: "2" in gw.server("us-east-0")["models"].get("lt", []), what="gateway to see version 2"
        )
        state, body = _cache_header(gw.http, x)
        assert state == "miss" and body["model_version"] == "2"
        state, body = _cache_header(gw.http, x)
        assert state == "hit" and body["model_version"] == "2"
    finally:
        stop_fleet(fleet)


def test_byte_identical_repeats_hit_and_near_copies_are_still_read(shared_gateway) -> None:
    """Repeats of the exact bytes are answered without reading them again (gateway/pipeline/cache_alias.py):
    the answer is the keyed hit's, and bytes that differ (a duplicate key, an id) are read as ever."""
    import json

    x = _row(160)
    inputs = [{"name": "features", "shape": [1, 8], "datatype": "FP32", "data": x.ravel().tolist()}]
    body = json.dumps({"inputs": inputs}).encode()

    def post(data: bytes) -> tuple[int, str | None, bytes]:
        req = urllib.request.Request(f"http://{shared_gateway.http}/v2/models/lt/infer", data=data)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.headers.get("x-skewserve-cache"), r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("x-skewserve-cache"), exc.read()

    first = post(body)
    repeats = [post(body) for _ in range(3)]
    assert first[:2] == (200, "miss")
    assert all(r == (200, "hit", first[2]) for r in repeats)
    spaced = post(json.dumps({"inputs": inputs}, indent=1).encode())
    assert spaced[:2] == (200, "hit") and json.loads(spaced[2]) == json.loads(first[2])
    with_id = post(json.dumps({"id": "mine", "inputs": inputs}).encode())
    assert with_id[:2] == (200, "hit") and json.loads(with_id[2])["id"] == "mine"
    doubled = body[:-1] + b', "inputs": []}'
    status, _, text = post(doubled)
    assert status == 400 and b"inputs" in text
    # Past EXACT_BYTES an alias is named by a digest of the bytes: repeats still hit, with the answer.
    large = json.dumps({"inputs": inputs}, indent=100).encode()  # under 16 KiB: keyed canonical
    assert len(large) > 2048
    assert [post(large)[:2] for _ in range(3)] == [(200, "hit")] * 3
    assert json.loads(post(large)[2]) == json.loads(first[2])


def test_an_alias_is_named_by_small_requests_bytes_and_by_a_digest_of_large_ones() -> None:
    from gateway.pipeline.cache_alias import EXACT_BYTES, ExactAliases

    assert ExactAliases.name(b"lt\0\0tenant", b"{}") == b"=lt\0\0tenant\0{}"
    large = b" " * EXACT_BYTES
    named = ExactAliases.name(b"lt", large)
    assert named[:1] == b"#" and len(named) == 17 and named == ExactAliases.name(b"lt", large)
    assert ExactAliases.name(b"lt", large + b" ") != named
    # Whatever differs, context (tenant, version, limits) or body, names another alias.
    assert len({ExactAliases.name(c, b) for c in (b"lt\0a", b"lt\0b") for b in (b"{}", b"{ }")}) == 4


def test_byte_identical_grpc_repeats_hit_with_the_keyed_answer(shared_gateway) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name="lt")
    req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    req.raw_input_contents.append(_row(170).tobytes())
    with grpc.insecure_channel(shared_gateway.grpc) as ch:
        infer = ch.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer", request_serializer=None, response_deserializer=None
        )
        answers = [infer.with_call(req.SerializeToString(), timeout=10) for _ in range(3)]
        req.id = "named"
        named, _ = infer.with_call(req.SerializeToString(), timeout=10)
    states = [dict(call.trailing_metadata())["x-skewserve-cache"] for _, call in answers]
    assert states == ["miss", "hit", "hit"]
    assert answers[1][0] == answers[2][0]
    first, repeat = (
        pb.ModelInferResponse.FromString(answers[0][0]),
        pb.ModelInferResponse.FromString(answers[2][0]),
    )
    assert repeat.raw_output_contents == first.raw_output_contents and repeat.id == ""
    assert pb.ModelInferResponse.FromString(named).id == "named"
