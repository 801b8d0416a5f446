"""Hostile clients and faults against gateway state, through real tritonserver, gateway and redis-server.

Bounded metric labels (issue 9 item 3), coalescing that does not share fate (6), Redis faults behind a
circuit breaker with background writes (10), rate limits shared across replicas (12), and Redis entry
integrity over namespace and key plus refusal of placeholder HMAC secrets (13).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from skewserve.ports import free_port
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, start_fleet, stop_fleet, wait_until

SECRET = secrets.token_hex(32)


# -- helpers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def solo(gateway_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: Any) -> Iterator[Any]:
    """One Triton server of our own: these tests stop and resume it."""
    fleet = start_fleet(gateway_repo, {"us-east": 1}, tmp_path_factory.mktemp("solo_logs"), prepared_triton)
    yield fleet
    stop_fleet(fleet)


def _triton(fleet: Any) -> TritonServer:
    server: TritonServer = fleet["us-east"][0]
    return server


def _row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)


def _body(x: np.ndarray) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
    ).encode()


def _post(
    address: str, model: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 30
) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        f"http://{address}/v2/models/{model}/infer", data=body, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def _outputs(body: dict[str, Any]) -> list[Any]:
    return [(o["name"], o["data"]) for o in body["outputs"]]


def _direct(fleet: Any, x: np.ndarray) -> list[Any]:
    status, body, _ = _post(_triton(fleet).http_address, "lt", _body(x))
    assert status == 200, body
    return _outputs(body)


def _metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


class RedisProcess:
    """A redis-server of this test's own, which it may pause, kill and restart on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is required (make setup installs it)"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

        def answers() -> bool:
            try:
                return bool(self.client().ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, 20, "redis-server to answer PING")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture()
def own_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    r = RedisProcess(tmp_path)
    r.start()
    yield r
    r.kill()


# -- 3: bounded labels -----------------------------------------------------------------------------
def test_invented_model_names_do_not_grow_metrics(solo, make_gateway) -> None:
    gw = make_gateway(gateway_config(solo))
    x = _row(1)
    status, body, _ = _post(gw.http, "lt", _body(x))
    assert status == 200
    g = grpcclient.InferenceServerClient(gw.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(x)
    g.infer("lt", [inp])
    for _ in range(3):  # every label value of the invented names' own status codes exists already
        assert _post(gw.http, "no-such-" + uuid.uuid4().hex, _body(x))[0] in (400, 404)
        with pytest.raises(InferenceServerException):
            g.infer("no-such-" + uuid.uuid4().hex, [inp])
    before = len(gw.metrics().encode())
    names = [f"m-{uuid.uuid4().hex}" for _ in range(400)]
    for name in names[:200]:
        assert _post(gw.http, name, _body(x))[0] in (400, 404)
    for name in names[200:]:
        with pytest.raises(InferenceServerException):
            g.infer(name, [inp])
    text = gw.metrics()
    assert len(text.encode()) <= before + 2048, f"/metrics grew from {before} to {len(text.encode())} bytes"
    assert not any(name in text for name in names)
    assert 'model="__other__"' in text and 'model="lt"' in text
    status, body, _ = _post(gw.http, "lt", _body(_row(2)))
    assert status == 200 and _outputs(body) == _direct(solo, _row(2))


def test_models_a_key_may_not_use_fold_into_one_label(solo, make_gateway) -> None:
    from gateway.state.auth import hash_key

    key = "sk-" + secrets.token_hex(16)
    gw = make_gateway(
        gateway_config(solo, auth={"keys": [{"name": "only-lt", "sha256": hash_key(key), "models": ["lt"]}]})
    )
    headers = {"Authorization": f"Bearer {key}"}
    assert _post(gw.http, "lt_nocache", _body(_row(3)), headers)[0] == 403
    assert _post(gw.http, "lt_nocache", _body(_row(3)))[0] == 401
    assert _post(gw.http, "lt", _body(_row(3)), headers)[0] == 200
    text = gw.metrics()
    assert 'model="lt_nocache"' not in text and 'model="lt"' in text and 'model="__other__"' in text


# -- 6: coalescing without shared fate -------------------------------------------------------------
def _held_gateway(solo: Any, make_gateway: Any) -> GatewayUnderTest:
    """A gateway that neither probes nor ejects during the test: Triton will be SIGSTOPped on purpose."""
    return make_gateway(
        gateway_config(
            solo,
            health={
                "interval_s": 60.0,
                "timeout_s": 1.0,
                "eject_after_failures": 1000,
                "base_ejection_s": 1.0,
            },
            retries={"max_attempts": 1},
        )
    )


class _Call(threading.Thread):
    """One HTTP request in a thread; records its status, body, and whether `other` had finished first."""

    def __init__(
        self, address: str, body: bytes, timeout_ms: int, other: threading.Event | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.address, self.body, self.timeout_ms, self.other = address, body, timeout_ms, other
        self.status = 0
        self.result: dict[str, Any] = {}
        self.other_done_first: bool | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.status, self.result, _ = _post(
                self.address, "lt", self.body, {"x-skewserve-timeout-ms": str(self.timeout_ms)}, timeout=60
            )
        finally:
            if self.other is not None:
                self.other_done_first = self.other.is_set()
            self.done.set()


def _upstream_inflight(gw: GatewayUnderTest) -> int:
    return int(gw.admin()["servers"][0]["inflight"])


def _coalesced(gw: GatewayUnderTest) -> float:
    return _metric(gw.metrics(), 'skewserve_gateway_coalesced_requests_total{model="lt"}')


def test_followers_end_at_their_own_deadline_behind_a_stuck_leader(solo, make_gateway) -> None:
    gw = _held_gateway(solo, make_gateway)
    x = _row(10)
    expected = _direct(solo, x)
    triton = _triton(solo)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(x)
    grpc_leader_done = threading.Event()
    grpc_leader: dict[str, Any] = {}

    def grpc_leader_callback(result: Any, error: Any) -> None:
        grpc_leader.update(result=result, error=error)
        grpc_leader_done.set()

    def grpc_follower(out: dict[str, Any]) -> None:
        try:  # its own 0.5 s deadline through the gateway's header; the client itself waits longer
            grpcclient.InferenceServerClient(gw.grpc).infer(
                "lt", [inp], headers={"x-skewserve-timeout-ms": "500"}, client_timeout=30
            )
            out["status"] = "OK"
        except InferenceServerException as exc:
            out["status"], out["message"] = exc.status(), exc.message()
        out["leader_done_first"] = grpc_leader_done.is_set()

    os.kill(triton.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        leader = _Call(gw.http, _body(x), 20_000)
        leader.start()
        grpcclient.InferenceServerClient(gw.grpc).async_infer(
            "lt", [inp], grpc_leader_callback, headers={"x-skewserve-timeout-ms": "20000"}, client_timeout=60
        )
        wait_until(lambda: _upstream_inflight(gw) == 2, 10, "both leaders' upstream calls")
        followers = [_Call(gw.http, _body(x), 500, other=leader.done) for _ in range(4)]
        grpc_outcomes: list[dict[str, Any]] = [{}, {}]
        grpc_threads = [threading.Thread(target=grpc_follower, args=(o,), daemon=True) for o in grpc_outcomes]
        for t in [*followers, *grpc_threads]:
            t.start()
        for f in followers:
            assert f.done.wait(15), "a follower waited past its own deadline"
        for t in grpc_threads:
            t.join(15)
            assert not t.is_alive(), "a gRPC follower waited past its own deadline"
        assert [f.status for f in followers] == [504] * 4
        assert all(f.other_done_first is False for f in followers), "followers must end before the leader"
        assert "waiting for an identical in-flight request" in followers[0].result["error"]
        assert [o["status"] for o in grpc_outcomes] == ["StatusCode.DEADLINE_EXCEEDED"] * 2, grpc_outcomes
        assert all(o["leader_done_first"] is False for o in grpc_outcomes)
        assert "waiting for an identical in-flight request" in grpc_outcomes[0]["message"]
        assert _coalesced(gw) == 6
    finally:
        os.kill(triton.pid, signal.SIGCONT)  # type: ignore[arg-type]
    assert leader.done.wait(30) and grpc_leader_done.wait(30)
    assert leader.status == 200 and _outputs(leader.result) == expected
    assert grpc_leader["error"] is None
    np.testing.assert_array_equal(
        grpc_leader["result"].as_numpy("probabilities"),
        np.array(dict(expected)["probabilities"], dtype=np.float32).reshape(1, -1),
    )


def test_a_follower_never_inherits_the_leaders_own_deadline(solo, make_gateway) -> None:
    gw = _held_gateway(solo, make_gateway)
    x = _row(11)
    expected = _direct(solo, x)
    triton = _triton(solo)
    os.kill(triton.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        leader = _Call(gw.http, _body(x), 1_000)
        leader.start()
        wait_until(lambda: _upstream_inflight(gw) == 1, 10, "the leader's upstream call")
        follower = _Call(gw.http, _body(x), 30_000, other=leader.done)
        follower.start()
        wait_until(lambda: _coalesced(gw) == 1, 10, "the follower to join the leader")
        assert leader.done.wait(15) and leader.status == 504
        assert not follower.done.is_set(), "the follower must not end with the leader's own 504"
    finally:
        os.kill(triton.pid, signal.SIGCONT)  # type: ignore[arg-type]
    assert follower.done.wait(30)
    assert follower.status == 200 and _outputs(follower.result) == expected


def test_a_cancelled_grpc_leader_does_not_fail_its_followers(solo, make_gateway) -> None:
    gw = _held_gateway(solo, make_gateway)
    x = _row(12)
    expected = _direct(solo, x)
    triton = _triton(solo)
    client = grpcclient.InferenceServerClient(gw.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(x)
    leader_done = threading.Event()
    follower_result: dict[str, Any] = {}
    follower_done = threading.Event()

    def follow() -> None:
        try:
            r = grpcclient.InferenceServerClient(gw.grpc).infer("lt", [inp], client_timeout=60)
            follower_result["out"] = r.as_numpy("probabilities")
        except Exception as exc:
            follower_result["error"] = repr(exc)
        finally:
            follower_done.set()

    os.kill(triton.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        call = client.async_infer("lt", [inp], lambda result, error: leader_done.set(), client_timeout=60)
        wait_until(lambda: _upstream_inflight(gw) == 1, 10, "the gRPC leader's upstream call")
        threading.Thread(target=follow, daemon=True).start()
        wait_until(lambda: _coalesced(gw) == 1, 10, "the follower to join the leader")
        call.cancel()
        assert leader_done.wait(10)
        wait_until(lambda: gw.admin()["inflight"] == 1, 10, "the cancelled leader to leave the gateway")
        assert not follower_done.is_set(), f"the follower ended with its leader: {follower_result}"
    finally:
        os.kill(triton.pid, signal.SIGCONT)  # type: ignore[arg-type]
    assert follower_done.wait(30)
    assert "error" not in follower_result, follower_result
    np.testing.assert_array_equal(
        follower_result["out"], np.array(dict(expected)["probabilities"], dtype=np.float32).reshape(1, -1)
    )


# -- 10: Redis faults ------------------------------------------------------------------------------
def _redis_state(gw: GatewayUnderTest) -> str:
    return str(gw.admin()["redis"]["breaker"])


def test_redis_paused_killed_and_restarted_never_fails_a_request(solo, make_gateway, own_redis) -> None:
    cache = {
        "backend": "redis",
        "redis_url": own_redis.url,
        "hmac_secret": SECRET,
        "namespace": "faults",
        "models": ["lt"],
        "redis_timeout_s": 0.1,
        "breaker_failures": 3,
        "breaker_cooldown_s": 0.3,
    }
    gw = make_gateway(gateway_config(solo, cache=cache))
    seed = itertools.count(1000)

    def ok_request(x: np.ndarray | None = None) -> str:
        x = _row(next(seed)) if x is None else x
        status, body, headers = _post(gw.http, "lt", _body(x))
        assert status == 200, body
        assert _outputs(body) == _direct(solo, x)
        return headers["x-skewserve-cache"]

    def until_breaker(state: str, what: str) -> None:
        # Requests drive the breaker (its probe starts on a request, in the background); bounded in
        # count and in time, since a request here takes a few milliseconds and a pause lasts seconds.
        deadline = time.monotonic() + 30
        for _ in range(20_000):
            ok_request()
            if _redis_state(gw) == state:
                return
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"the breaker never became {state} {what}: {gw.admin()['redis']}")

    x0 = _row(1)
    assert ok_request(x0) == "miss"
    wait_until(lambda: bool(own_redis.client().keys("faults:*")), 10, "the background write")
    # A lookup past the 0.1 s bound on a loaded machine reads as a miss: wait for the hit.
    wait_until(lambda: ok_request(x0) == "hit", 10, "the stored answer to be served")

    # A pause that ends by itself: while paused Redis holds every command, a connecting client's too.
    own_redis.client().execute_command("CLIENT", "PAUSE", "3000", "ALL")
    until_breaker("open", "with redis paused")
    for _ in range(3):
        ok_request()
    until_breaker("closed", "after the pause ended")
    # At least once: a loaded machine can also open it on a slow call before the pause.
    opened = _metric(gw.metrics(), "skewserve_gateway_redis_breaker_opened_total")
    assert opened >= 1

    own_redis.kill()
    until_breaker("open", "with redis killed")
    for _ in range(5):
        ok_request()
    own_redis.start()  # same port, empty
    until_breaker("closed", "after redis restarted")
    assert _metric(gw.metrics(), "skewserve_gateway_redis_breaker_opened_total") > opened
    x1 = _row(2)
    assert ok_request(x1) == "miss"
    # Other misses' writes may land too (the breaker closed mid-loop): wait for this entry, read back.
    wait_until(lambda: ok_request(x1) == "hit", 10, "x1's background write to be served")
    log = Path(gw.log_path).read_text()
    redis_lines = [line for line in log.splitlines() if "redis" in line.lower()]
    assert len(redis_lines) <= 12, f"{len(redis_lines)} log lines about redis: a log storm"


# -- 12: shared limits -----------------------------------------------------------------------------
def test_a_keys_quota_is_shared_by_two_replicas(solo, make_gateway, redis_url: str) -> None:
    from gateway.state.auth import hash_key

    key = "sk-" + secrets.token_hex(16)
    cfg = {
        "auth": {"keys": [{"name": "quota", "sha256": hash_key(key), "rate_per_s": 0.001, "burst": 4}]},
        "cache": {
            "backend": "redis",
            "redis_url": redis_url,
            "hmac_secret": SECRET,
            "namespace": "q-" + uuid.uuid4().hex[:8],
            "models": ["lt"],
            "redis_timeout_s": 5.0,  # a loaded CI machine must not turn the shared quota local
        },
    }
    gw1 = make_gateway(gateway_config(solo, **cfg))
    gw2 = make_gateway(gateway_config(solo, **cfg))
    headers = {"Authorization": f"Bearer {key}"}
    statuses = [_post(gw.http, "lt", _body(_row(20)), headers)[0] for gw in (gw1, gw2) * 5]
    assert sorted(statuses) == [200] * 4 + [429] * 6, statuses
    status, body, resp_headers = _post(gw2.http, "lt", _body(_row(20)), headers)
    assert status == 429 and "rate limit for API key 'quota' exceeded" in body["error"]
    assert int(resp_headers["retry-after"]) >= 1

    # Redis down: each replica falls back to its own bucket, never to "no limit" nor to an error.
    down = dict(cfg, cache={**cfg["cache"], "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    gw3 = make_gateway(gateway_config(solo, **down))
    statuses = [_post(gw3.http, "lt", _body(_row(21)), headers)[0] for _ in range(6)]
    assert statuses == [200] * 4 + [429] * 2


def test_per_client_address_limit_when_auth_is_off(solo, make_gateway) -> None:
    gw = make_gateway(gateway_config(solo, limits={"per_client_rate_per_s": 0.001, "per_client_burst": 3}))
    statuses = [_post(gw.http, "lt", _body(_row(30)))[0] for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    status, body, _ = _post(gw.http, "lt", _body(_row(30)))
    assert status == 429 and "rate limit for client address '127.0.0.1' exceeded" in body["error"]
    g = grpcclient.InferenceServerClient(gw.grpc)
    inp = grpcclient.InferInput("features", [1, 8], "FP32")
    inp.set_data_from_numpy(_row(30))
    with pytest.raises(InferenceServerException, match="rate limit for client address '127.0.0.1'"):
        g.infer("lt", [inp])


# -- 13: entry integrity and secrets ---------------------------------------------------------------
def test_an_entry_copied_to_another_key_or_namespace_is_rejected(solo, make_gateway, redis_url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    base = {"backend": "redis", "redis_url": redis_url, "hmac_secret": SECRET, "models": ["lt"]}
    gw_a = make_gateway(gateway_config(solo, cache={**base, "namespace": f"a-{tag}"}))
    gw_b = make_gateway(gateway_config(solo, cache={**base, "namespace": f"b-{tag}"}))
    client = redis.Redis.from_url(redis_url)
    x, y = _row(40), _row(41)
    assert _post(gw_a.http, "lt", _body(x))[2]["x-skewserve-cache"] == "miss"
    wait_until(lambda: len(client.keys(f"a-{tag}:*")) == 1, 10, "x's entry in redis")
    (key_x,) = client.keys(f"a-{tag}:*")
    assert _post(gw_a.http, "lt", _body(y))[2]["x-skewserve-cache"] == "miss"
    wait_until(lambda: len(client.keys(f"a-{tag}:*")) == 2, 10, "y's entry in redis")
    (key_y,) = set(client.keys(f"a-{tag}:*")) - {key_x}
    value_x = client.get(key_x)

    client.set(key_y, value_x)  # x's answer filed under y's key
    status, body, headers = _post(gw_a.http, "lt", _body(y))
    assert status == 200 and headers["x-skewserve-cache"] == "miss"
    assert _outputs(body) == _direct(solo, y)

    client.set(f"b-{tag}:" + key_x.decode().split(":", 1)[1], value_x)  # same key, other namespace
    status, body, headers = _post(gw_b.http, "lt", _body(x))
    assert status == 200 and headers["x-skewserve-cache"] == "miss"
    assert _outputs(body) == _direct(solo, x)
    assert _metric(gw_a.metrics(), "skewserve_gateway_cache_integrity_failures_total") == 1
    assert _metric(gw_b.metrics(), "skewserve_gateway_cache_integrity_failures_total") == 1


@pytest.mark.parametrize(
    "secret", ["change-me-to-a-long-random-secret", "a" * 40, "abababababababababababab", "x" * 32]
)
def test_a_placeholder_hmac_secret_is_refused_at_start(tmp_path: Path, secret: str) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        f"home_region: a\ncache: {{backend: redis, hmac_secret: '{secret}'}}\n"
        "regions: [{name: a, servers: [{name: s, http: '127.0.0.1:1', grpc: '127.0.0.1:2'}]}]\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "skewserve", "gateway", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "cache.hmac_secret" in out and "secrets.token_hex(32)" in out
    assert secret not in out  # the refused value is never echoed: it may be a real, weak secret


def test_the_example_config_needs_a_real_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.config import ConfigError, load_gateway_config

    example = Path(__file__).resolve().parents[2] / "deploy" / "gateway.example.yaml"
    monkeypatch.delenv("SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET", raising=False)
    with pytest.raises(ConfigError, match="cache.hmac_secret"):
        load_gateway_config(example)
    monkeypatch.setenv("SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET", secrets.token_hex(32))
    assert load_gateway_config(example).cache.backend == "redis"
