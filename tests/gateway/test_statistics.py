"""Triton's statistics extension through the gateway: aggregated across servers, Triton's format.

A 2-region fleet of one server each; requests with known counts go directly to each server and
through the gateway, and the gateway's answer must equal the sum of the servers' own statistics.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gateway.pipeline.statistics import merge_statistics
from gateway.state.auth import hash_key
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import gateway_config, start_fleet, stop_fleet, wait_until

KEY = "sk-stats-lt-only-4e7d2a91"
X = np.full((1, 8), 0.5, np.float32)


@pytest.fixture(scope="module")
def small_fleet(
    gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    f = start_fleet(
        gateway_repo, {"us-east": 1, "eu-west": 1}, tmp_path_factory.mktemp("logs"), prepared_triton
    )
    yield f
    stop_fleet(f)


@pytest.fixture()
def gw(small_fleet, make_gateway):
    auth = {"keys": [{"name": "lt-only", "sha256": hash_key(KEY), "models": ["lt"]}]}
    return make_gateway(gateway_config(small_fleet, auth=auth, cache={"backend": "none"}))


def _servers(fleet: dict[str, list[TritonServer]]) -> list[TritonServer]:
    return [s for servers in fleet.values() for s in servers]


def _http_infer(address: str, model: str, n: int, **headers: str) -> None:
    client = httpclient.InferenceServerClient(address)
    inp = httpclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(X)
    for _ in range(n):
        client.infer(model, [inp], headers=headers or None)


def _grpc_infer(address: str, model: str, n: int, **headers: str) -> None:
    client = grpcclient.InferenceServerClient(address)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(X)
    for _ in range(n):
        client.infer(model, [inp], headers=headers or None)


def _http_stats(address: str, model: str = "", version: str = "", **headers: str) -> dict[str, Any]:
    return httpclient.InferenceServerClient(address).get_inference_statistics(
        model, version, headers=headers or None
    )


def _grpc_stats(address: str, model: str = "", version: str = "", **headers: str) -> dict[str, Any]:
    return grpcclient.InferenceServerClient(address).get_inference_statistics(
        model, version, headers=headers or None, as_json=True
    )


def _entry(stats: dict[str, Any], model: str) -> dict[str, Any]:
    return next(m for m in stats["model_stats"] if m["name"] == model)


def _count(entry: dict[str, Any]) -> int:
    return int(entry.get("inference_count", 0))


def _summed(entries: list[dict[str, Any]]) -> dict[str, int]:
    """The test's own sum of the fields a benchmarking tool reads, independent of the gateway's merge."""
    out: dict[str, int] = {"inference_count": 0, "execution_count": 0}
    for e in entries:
        out["inference_count"] += int(e.get("inference_count", 0))
        out["execution_count"] += int(e.get("execution_count", 0))
        for stat, v in e.get("inference_stats", {}).items():
            for field in ("count", "ns"):
                key = f"{stat}.{field}"
                out[key] = out.get(key, 0) + int(v.get(field, 0))
    return out


def test_http_statistics_are_the_sum_of_the_servers(small_fleet, gw) -> None:
    a, b = _servers(small_fleet)
    before = _count(_entry(_http_stats(gw.http, "lt", authorization=f"Bearer {KEY}"), "lt"))
    _http_infer(a.http_address, "lt", 3)
    _http_infer(b.http_address, "lt", 5)
    _http_infer(gw.http, "lt", 4, authorization=f"Bearer {KEY}")
    # Triton counts an inference after it has sent the answer: wait until all 12 are counted.
    wait_until(
        lambda: (
            _count(_entry(_http_stats(gw.http, "lt", authorization=f"Bearer {KEY}"), "lt")) - before
            >= 3 + 5 + 4
        ),
        what="Triton to count the 12 inferences",
    )
    direct = [_entry(_http_stats(s.http_address, "lt"), "lt") for s in (a, b)]
    via = _http_stats(gw.http, "lt", authorization=f"Bearer {KEY}")
    assert [m["name"] for m in via["model_stats"]] == ["lt"]
    entry = _entry(via, "lt")
    assert _count(entry) - before == 3 + 5 + 4
    assert _summed([entry]) == _summed(direct)
    assert entry["last_inference"] == max(d["last_inference"] for d in direct)
    # The same through a pinned version path.
    assert _summed([_entry(_http_stats(gw.http, "lt", "1", authorization=f"Bearer {KEY}"), "lt")]) == _summed(
        direct
    )


def test_grpc_statistics_are_the_sum_of_the_servers(small_fleet, gw) -> None:
    a, b = _servers(small_fleet)
    before = sum(_count(_entry(_grpc_stats(s.grpc_address, "lt"), "lt")) for s in (a, b))
    _grpc_infer(a.grpc_address, "lt", 2)
    _grpc_infer(b.grpc_address, "lt", 6)
    _grpc_infer(gw.grpc, "lt", 3, authorization=f"Bearer {KEY}")
    # Triton counts an inference after it has sent the answer: wait until all 11 are counted.
    wait_until(
        lambda: sum(_count(_entry(_grpc_stats(s.grpc_address, "lt"), "lt")) for s in (a, b)) - before >= 11,
        what="Triton to count the 11 inferences",
    )
    direct = [_entry(_grpc_stats(s.grpc_address, "lt"), "lt") for s in (a, b)]
    via = _entry(_grpc_stats(gw.grpc, "lt", authorization=f"Bearer {KEY}"), "lt")
    assert _summed([via]) == _summed(direct)
    assert _count(via) == sum(_count(d) for d in direct)
    assert via.get("batch_stats") and sum(
        int(s["compute_infer"]["count"]) for s in via["batch_stats"]
    ) == sum(int(s["compute_infer"]["count"]) for d in direct for s in d["batch_stats"])


def test_all_models_statistics_are_aggregated_not_forwarded_as_a_model_named_stats(small_fleet, gw) -> None:
    a, b = _servers(small_fleet)
    _http_infer(a.http_address, "lt_nocache", 2)
    _http_infer(b.http_address, "lt_nocache", 1)
    # A key limited to `lt` sees only `lt`; statistics of other models are not its business.
    limited = _http_stats(gw.http, authorization=f"Bearer {KEY}")
    assert {m["name"] for m in limited["model_stats"]} == {"lt"}
    with pytest.raises(InferenceServerException) as info:
        _http_stats(gw.http, "lt_nocache", authorization=f"Bearer {KEY}")
    assert "may not use model 'lt_nocache'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        _grpc_stats(gw.grpc, "lt_nocache", authorization=f"Bearer {KEY}")
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    with pytest.raises(InferenceServerException) as info:
        _http_stats(gw.http, "lt")
    assert "missing API key" in info.value.message()


def test_unknown_model_and_pinned_region(small_fleet, make_gateway) -> None:
    a, b = _servers(small_fleet)
    gw = make_gateway(gateway_config(small_fleet, cache={"backend": "none"}))
    _http_infer(a.http_address, "lt_nocache", 1)
    everything = _http_stats(gw.http)

    def agreed() -> bool:
        # Triton books an answer just after sending it (this one, or an earlier test's): the
        # gateway's sum and the servers' own figures agree once every answer is booked, and never
        # when the gateway sums wrongly
        nonlocal everything
        everything = _http_stats(gw.http)
        direct = [_http_stats(s.http_address) for s in (a, b)]
        return all(
            _summed([_entry(everything, model)]) == _summed([_entry(d, model) for d in direct])
            for model in ("lt", "lt_nocache")
        )

    wait_until(agreed, 30, "the gateway's statistics to equal the sum of the servers'")
    assert {m["name"] for m in everything["model_stats"]} == {"lt", "lt_nocache"}
    # Pinned to a region: that region's server alone, in both protocols.
    header = {"x-skewserve-region": "eu-west"}
    assert _summed([_entry(_http_stats(gw.http, "lt_nocache", **header), "lt_nocache")]) == _summed(
        [_entry(_http_stats(b.http_address, "lt_nocache"), "lt_nocache")]
    )
    assert _summed([_entry(_grpc_stats(gw.grpc, "lt_nocache", **header), "lt_nocache")]) == _summed(
        [_entry(_grpc_stats(b.grpc_address, "lt_nocache"), "lt_nocache")]
    )
    # Pinned to one server by name: that server's own figures; an unknown name is a 400.
    one = {"x-skewserve-server": "us-east-0"}
    assert _summed([_entry(_grpc_stats(gw.grpc, "lt_nocache", **one), "lt_nocache")]) == _summed(
        [_entry(_grpc_stats(a.grpc_address, "lt_nocache"), "lt_nocache")]
    )
    with pytest.raises(InferenceServerException) as bad:
        _http_stats(gw.http, "lt", **{"x-skewserve-server": "nope"})
    assert "x-skewserve-server names unknown server 'nope'" in bad.value.message()
    with pytest.raises(InferenceServerException) as bad:
        _grpc_stats(gw.grpc, "lt", **{"x-skewserve-region": "mars"})
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
    # An unknown model: Triton's own answer, in each protocol.
    with pytest.raises(InferenceServerException) as via:
        _http_stats(gw.http, "nope")
    with pytest.raises(InferenceServerException) as want:
        _http_stats(a.http_address, "nope")
    assert via.value.message() == want.value.message()
    with pytest.raises(InferenceServerException) as gvia:
        _grpc_stats(gw.grpc, "nope")
    with pytest.raises(InferenceServerException) as gwant:
        _grpc_stats(a.grpc_address, "nope")
    assert (gvia.value.status(), gvia.value.message()) == (gwant.value.status(), gwant.value.message())


def test_the_raw_http_routes_answer_in_tritons_shape(small_fleet, make_gateway) -> None:
    gw = make_gateway(gateway_config(small_fleet, cache={"backend": "none"}))
    for path in ("/v2/models/stats", "/v2/models/lt/stats", "/v2/models/lt/versions/1/stats"):
        with urllib.request.urlopen(f"http://{gw.http}{path}", timeout=10) as r:
            body = json.loads(r.read())
            assert r.headers["x-skewserve-stats-servers"] == "us-east-0,eu-west-0"
        assert body["model_stats"] and all(
            {"name", "version", "inference_stats"} <= set(m) for m in body["model_stats"]
        )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{gw.http}/v2/models/lt/stats?x=1", data=b"{}", timeout=10)
    assert info.value.code in (404, 405)


def test_merge_sums_counts_and_keeps_identities() -> None:
    one = {
        "model_stats": [
            {
                "name": "m",
                "version": "1",
                "last_inference": 10,
                "inference_count": 2,
                "inference_stats": {"success": {"count": 2, "ns": 100}},
                "batch_stats": [{"batch_size": 1, "compute_infer": {"count": 2, "ns": 50}}],
                "memory_usage": [],
            }
        ]
    }
    two = {
        "model_stats": [
            {
                "name": "m",
                "version": "1",
                "last_inference": "7",  # protobuf's JSON mapping writes 64-bit integers as strings
                "inference_count": "3",
                "inference_stats": {"success": {"count": "3", "ns": "1"}, "fail": {"count": "1", "ns": "5"}},
                "batch_stats": [
                    {"batch_size": "1", "compute_infer": {"count": "3", "ns": "5"}},
                    {"batch_size": "4", "compute_infer": {"count": "1", "ns": "9"}},
                ],
            },
            {"name": "m", "version": "2", "inference_count": "1"},
        ]
    }
    merged = merge_statistics([one, two])
    assert merged == {
        "model_stats": [
            {
                "name": "m",
                "version": "1",
                "last_inference": 10,
                "inference_count": 5,
                "inference_stats": {"success": {"count": 5, "ns": 101}, "fail": {"count": 1, "ns": 5}},
                "batch_stats": [
                    {"batch_size": 1, "compute_infer": {"count": 5, "ns": 55}},
                    {"batch_size": 4, "compute_infer": {"count": 1, "ns": 9}},
                ],
                "memory_usage": [],
            },
            {"name": "m", "version": "2", "inference_count": 1},
        ]
    }


def test_a_dead_server_is_left_out_not_a_failure(
    gateway_repo: Path, tmp_path: Path, prepared_triton: PreparedTriton, make_gateway
) -> None:
    """Statistics keep answering while a server is lost: the survivors' sum, and which they are."""
    fleet = start_fleet(gateway_repo, {"us-east": 1, "eu-west": 1}, tmp_path / "logs", prepared_triton)
    try:
        a, b = _servers(fleet)
        gw = make_gateway(gateway_config(fleet, cache={"backend": "none"}))
        _http_infer(b.http_address, "lt", 2)
        assert b.pid is not None
        os.killpg(b.pid, signal.SIGKILL)  # no drain: it may still look healthy to the gateway
        for address, fetch in ((gw.http, _http_stats), (gw.grpc, _grpc_stats)):
            got = _entry(fetch(address, "lt"), "lt")
            direct = a.http_address if fetch is _http_stats else a.grpc_address
            assert _summed([got]) == _summed([_entry(fetch(direct, "lt"), "lt")])
        with urllib.request.urlopen(f"http://{gw.http}/v2/models/lt/stats", timeout=10) as r:
            assert r.headers["x-skewserve-stats-servers"] == a.spec.name
    finally:
        stop_fleet(fleet)
