"""Issue 35 items 1-2, against real processes: one tritonserver holding an edge model (a small,
briefly trained artifact) and a cloud model (the shared small artifact), one gateway serving them as
cascades. The cascade's answers equal the rule applied offline to both models' own answers, item by
item, over HTTP (JSON, binary and raw binary bodies) and gRPC; a cloud stage that is unreachable or
held past its stage deadline leaves the edge's answer, marked offline; a cached answer is never
served under a changed rule. (The table models have no raw-bytes ensemble, `<name>_raw`: raw bytes
here are Triton's raw binary request, the tensor's bytes as the whole body.)"""

from __future__ import annotations

import http.client
import json
import re
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as pb

from gateway.fleet.cascade_rule import NEVER_KEEP, DeferralRule, read_rule, rule_document, write_rule
from gateway.state.auth import hash_key
from skewserve.ports import free_port
from skewserve.triton_dist import PreparedTriton
from tests.gateway.conftest import (
    gateway_config,
    launch_gateway,
    start_fleet,
    stop_fleet,
    wait_until,
)
from tests.gateway.relay import TcpRelay
from tests.gateway.tls_certs import self_signed_certificate
from tests.process_helpers import cli_process, read_until

pytestmark = pytest.mark.slow
CLASSES = 5  # the small data set's (tests/conftest.py small_data)
ITEMS = 24


@pytest.fixture(scope="module")
def cascade_repo(small_artifact: Path, small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from exporter.pipeline import export_artifact
    from training.config import TrainConfig
    from training.launch import train

    edge = tmp_path_factory.mktemp("edge_artifact") / "edge"
    train(TrainConfig(data_dir=small_data, out_dir=edge, epochs=1, width=8, progress=False))
    repo = tmp_path_factory.mktemp("cascade_repo")
    export_artifact(edge, repo, "edge", tensorrt="off")
    export_artifact(small_artifact, repo, "cloud", tensorrt="off")
    return repo


@pytest.fixture(scope="module")
def triton(cascade_repo: Path, tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton):
    fleet = start_fleet(cascade_repo, {"near": 1}, tmp_path_factory.mktemp("cascade_logs"), prepared_triton)
    yield fleet["near"][0]
    stop_fleet(fleet)


def _rows(n: int = ITEMS) -> np.ndarray[Any, Any]:
    return np.random.default_rng(35).normal(0, 1.5, size=(n, 8)).astype(np.float32)


def _json_body(row: np.ndarray[Any, Any], binary: bool = False) -> tuple[bytes, dict[str, str]]:
    if not binary:
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": row.tolist()}]}
        return json.dumps(body).encode(), {"content-type": "application/json"}
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "datatype": "FP32",
                    "shape": [1, 8],
                    "parameters": {"binary_data_size": 32},
                }
            ],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return head + row.astype(np.float32).tobytes(), {"inference-header-content-length": str(len(head))}


def _post(
    address: str, model: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body, headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _http_answer(
    status: int, headers: dict[str, str], body: bytes
) -> tuple[dict[str, Any], np.ndarray[Any, Any]]:
    """The JSON header and the probabilities of one answer."""
    assert status == 200, body[:300]
    n = int(headers.get("inference-header-content-length", len(body)))
    head = json.loads(body[:n])
    out = next(o for o in head["outputs"] if o["name"] == "probabilities")
    if "data" in out:
        return head, np.asarray(out["data"], dtype=np.float32)
    offset = n
    for o in head["outputs"]:
        if o["name"] == "probabilities":
            break
        offset += o.get("parameters", {}).get("binary_data_size", 0)
    return head, np.frombuffer(body[offset : offset + out["parameters"]["binary_data_size"]], np.float32)


def _direct(triton, model: str, row: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    body, headers = _json_body(row)
    return _http_answer(*_post(triton.http_address, model, body, headers))[1]


def _grpc(
    address: str, model: str, row: np.ndarray[Any, Any]
) -> tuple[pb.ModelInferResponse, dict[str, str]]:
    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
    req.raw_input_contents.append(row.astype(np.float32).tobytes())
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        resp, call = infer.with_call(req, timeout=30)
        return resp, dict(call.trailing_metadata() or ())


def _grpc_probabilities(resp: pb.ModelInferResponse) -> np.ndarray[Any, Any]:
    i = [o.name for o in resp.outputs].index("probabilities")
    return np.frombuffer(resp.raw_output_contents[i], np.float32)


def _params(resp: pb.ModelInferResponse) -> dict[str, Any]:
    return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in resp.parameters.items()}


def _rule(path: Path, thresholds: list[float], version: int, temperature: float = 1.5) -> DeferralRule:
    write_rule(
        path,
        rule_document(
            "per_class", [f"class_{i:02d}" for i in range(CLASSES)], temperature, thresholds, version
        ),
    )
    return read_rule(path)


@pytest.fixture(scope="module")
def setup(triton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    rules = tmp_path_factory.mktemp("rules")
    rows = _rows()
    # Thresholds at each class's median calibrated score over the test rows: about half escalate.
    edge_p = np.stack([_direct(triton, "edge", r) for r in rows])
    scores = DeferralRule("per_class", "probabilities", ("",) * CLASSES, 1.5, (0.0,) * CLASSES, 0, "").judge
    cal = [scores(p[None, :]) for p in edge_p]
    thresholds = []
    for k in range(CLASSES):
        mine = [v.score for v in cal if v is not None and v.classes[0] == k]
        thresholds.append(float(np.median(mine)) if mine else 0.0)
    split = _rule(rules / "split.json", thresholds, 1)
    assert 0 < int(split.keeps(edge_p).sum()) < len(rows), "the rows should split between the stages"
    always_escalate = _rule(rules / "escalate.json", [NEVER_KEEP] * CLASSES, 1)
    cached_rule = _rule(rules / "cached.json", [0.0] * CLASSES, 1)  # keeps every edge answer
    held = TcpRelay(triton.http_address, hold=True)
    keyed = TcpRelay(triton.http_address)  # another gateway's stand-in: records what it was sent
    key_file = rules / "cloud.key"
    key_file.write_text("the-cloud-key\n")
    held_grpc = TcpRelay(triton.grpc_address, hold=True)
    server = {"name": "t-near", "http": triton.http_address, "grpc": triton.grpc_address}
    far = {"name": "t-far", "http": triton.http_address, "grpc": triton.grpc_address}
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    # the cloud behind its own gateway: TLS on its public ports, and the edge site's key required
    cert, cert_key = self_signed_certificate(tmp_path_factory.mktemp("cloud_tls"))
    cloud_gw = launch_gateway(
        gateway_config(
            {},
            home="cloud",
            regions=[{"name": "cloud", "servers": [{**far, "name": "t-cloud"}]}],
            listen={"tls": {"cert_file": str(cert), "key_file": str(cert_key)}},
            auth={"keys": [{"name": "edge-site", "sha256": hash_key("the-cloud-key")}]},
            cache={"backend": "none"},
        ),
        tmp_path_factory.mktemp("cloud_gw"),
    )
    tls_stage = {"http": cloud_gw.http, "grpc": cloud_gw.grpc, "tls": True, "api_key_file": str(key_file)}

    def cascade(name: str, rule: Path, cloud: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": name,
            "stages": [
                {"name": "edge", "model": "edge", "rule": str(rule), "deadline_s": 10},
                {"name": "cloud", "model": "cloud", **cloud},
            ],
        }

    cfg = gateway_config(
        {},
        home="near",
        regions=[{"name": "near", "servers": [server]}, {"name": "far", "servers": [far]}],
        cache={"backend": "memory", "models": ["digits-cached"], "ttl_s": 300},
        cascades=[
            cascade("digits", rules / "split.json", {"region": "far"}),
            cascade("digits-cached", rules / "cached.json", {"region": "far"}),
            cascade(
                "digits-slow-cloud",
                rules / "escalate.json",
                {"gateway": {"http": held.address, "grpc": held_grpc.address}, "deadline_s": 0.5},
            ),
            cascade(
                "digits-no-cloud", rules / "escalate.json", {"gateway": {"http": closed, "grpc": closed}}
            ),
            # only test_metrics_count_what_the_requests_did sends to these two
            cascade("digits-metered", rules / "split.json", {"region": "far"}),
            cascade(
                "digits-metered-offline",
                rules / "escalate.json",
                {"gateway": {"http": closed, "grpc": closed}},
            ),
            cascade(
                "digits-keyed",
                rules / "escalate.json",
                {
                    "gateway": {
                        "http": keyed.address,
                        "grpc": closed,
                        "api_key_file": str(key_file),
                        "plaintext": True,
                    }
                },
            ),
            cascade("digits-tls", rules / "escalate.json", {"gateway": {**tls_stage, "ca_file": str(cert)}}),
            # no ca_file: the default roots, which never signed the cloud's certificate
            cascade("digits-tls-untrusted", rules / "escalate.json", {"gateway": tls_stage}),
        ],
    )
    gw = launch_gateway(cfg, tmp_path_factory.mktemp("cascade_gw"))
    try:
        for g in (gw, cloud_gw):
            wait_until(
                lambda g=g: all(s["models"].get("cloud") for s in g.admin()["servers"]), 30, "models ready"
            )
        yield {
            "gw": gw,
            "triton": triton,
            "rows": rows,
            "split": split,
            "escalate": always_escalate,
            "cached": cached_rule,
            "rules": rules,
            "held": (held, held_grpc),
            "keyed": keyed,
            "cloud_gw": cloud_gw,
            "cloud_ca": cert,
        }
    finally:
        gw.stop()
        cloud_gw.stop()
        for relay in (held, held_grpc, keyed):
            relay.release()
            relay.close()


@pytest.mark.parametrize("form", ["json", "binary", "raw"])
def test_http_answers_equal_the_rule_applied_offline_item_by_item(setup, form: str) -> None:
    gw, triton, rule = setup["gw"], setup["triton"], setup["split"]
    stages = []
    for row in setup["rows"]:
        edge, cloud = _direct(triton, "edge", row), _direct(triton, "cloud", row)
        verdict = rule.judge(edge[None, :])
        assert verdict is not None
        expected = "edge" if verdict.keep else "cloud"
        if form == "raw":  # Triton's raw binary request: the tensor's bytes are the whole body
            body, headers = row.tobytes(), {"inference-header-content-length": "0"}
        else:
            body, headers = _json_body(row, binary=form == "binary")
        status, resp_headers, resp_body = _post(gw.http, "digits", body, headers)
        head, probabilities = _http_answer(status, resp_headers, resp_body)
        assert head["model_name"] == expected
        np.testing.assert_array_equal(probabilities, edge if expected == "edge" else cloud)
        assert head["parameters"]["cascade_stage"] == expected
        assert head["parameters"]["cascade_score"] == pytest.approx(verdict.score, abs=1e-6)
        assert head["parameters"]["cascade_rule"] == rule.tag
        assert head["parameters"]["cascade_offline"] is False
        assert resp_headers["x-skewserve-cascade-stage"] == expected
        assert float(resp_headers["x-skewserve-cascade-score"]) == pytest.approx(verdict.score, abs=1e-6)
        assert resp_headers["x-skewserve-cascade-offline"] == "false"
        assert resp_headers["x-skewserve-region"] == ("near" if expected == "edge" else "far")
        stages.append(expected)
    assert {"edge", "cloud"} <= set(stages)


def test_grpc_answers_equal_the_rule_applied_offline_item_by_item(setup) -> None:
    gw, triton, rule = setup["gw"], setup["triton"], setup["split"]
    stages = []
    for row in setup["rows"]:
        edge = _grpc_probabilities(_grpc(triton.grpc_address, "edge", row)[0])
        cloud = _grpc_probabilities(_grpc(triton.grpc_address, "cloud", row)[0])
        verdict = rule.judge(edge[None, :])
        assert verdict is not None
        expected = "edge" if verdict.keep else "cloud"
        resp, trailing = _grpc(gw.grpc, "digits", row)
        assert resp.model_name == expected
        np.testing.assert_array_equal(_grpc_probabilities(resp), edge if expected == "edge" else cloud)
        params = _params(resp)
        assert (params["cascade_stage"], params["cascade_rule"], params["cascade_offline"]) == (
            expected,
            rule.tag,
            False,
        )
        assert params["cascade_score"] == pytest.approx(verdict.score, abs=1e-6)
        assert trailing["x-skewserve-cascade-stage"] == expected
        assert trailing["x-skewserve-cascade-offline"] == "false"
        stages.append(expected)
    assert {"edge", "cloud"} <= set(stages)


@pytest.mark.parametrize("cascade", ["digits-slow-cloud", "digits-no-cloud"])
def test_a_cloud_stage_unreachable_or_past_its_deadline_leaves_the_edge_answer_marked(
    setup, cascade: str
) -> None:
    """Every request escalates (the rule keeps nothing); the cloud behind a relay that holds every
    request past the stage's 0.5 s deadline, or behind a port nothing listens on, never answers: the
    edge's answer comes back, marked offline, on both protocols, and nothing fails."""
    gw, triton, rule = setup["gw"], setup["triton"], setup["escalate"]
    for row in setup["rows"][:3]:
        edge = _direct(triton, "edge", row)
        verdict = rule.judge(edge[None, :])
        assert verdict is not None and not verdict.keep
        body, headers = _json_body(row)
        status, resp_headers, resp_body = _post(gw.http, cascade, body, headers)
        head, probabilities = _http_answer(status, resp_headers, resp_body)
        assert head["model_name"] == "edge"
        np.testing.assert_array_equal(probabilities, edge)
        assert head["parameters"]["cascade_offline"] is True
        assert head["parameters"]["cascade_score"] == pytest.approx(verdict.score, abs=1e-6)
        assert resp_headers["x-skewserve-cascade-offline"] == "true"
        assert resp_headers["x-skewserve-cascade-stage"] == "edge"
        resp, trailing = _grpc(gw.grpc, cascade, row)
        np.testing.assert_array_equal(_grpc_probabilities(resp), edge)
        assert _params(resp)["cascade_offline"] is True
        assert trailing["x-skewserve-cascade-offline"] == "true"
    if cascade == "digits-slow-cloud":  # the stage was tried: its requests reached the relay, held there
        held_http, held_grpc = setup["held"]
        assert b"/v2/models/cloud/infer" in bytes(held_http.sent)
        assert len(held_grpc.sent) > 0


def test_a_cached_answer_is_never_served_under_a_changed_rule(setup) -> None:
    """The rule's version and digest are in the cache key: a rule that escalates what the old one
    kept, applied by a reload, gets the cloud's answer, not the edge's answer cached before."""
    gw, rules = setup["gw"], setup["rules"]
    row = setup["rows"][0]
    body, headers = _json_body(row)

    def ask_http() -> tuple[str, str, str]:
        status, h, b = _post(gw.http, "digits-cached", body, headers)
        head, _ = _http_answer(status, h, b)
        return head["model_name"], h["x-skewserve-cache"], h["x-skewserve-cascade-stage"]

    def ask_grpc() -> tuple[str, str, str]:
        resp, trailing = _grpc(gw.grpc, "digits-cached", row)
        return resp.model_name, trailing["x-skewserve-cache"], trailing["x-skewserve-cascade-stage"]

    assert ask_http() == ("edge", "miss", "edge")
    assert ask_http() == ("edge", "hit", "edge")  # the stage is named on a hit too (stored with it)
    assert ask_grpc() == ("edge", "miss", "edge")
    assert ask_grpc() == ("edge", "hit", "edge")
    changed = _rule(rules / "cached.json", [NEVER_KEEP] * CLASSES, 2)
    gw.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: gw.admin()["cascades"]["digits-cached"]["rule"] == changed.tag, 30, "the new rule")
    assert ask_http() == ("cloud", "miss", "cloud")
    assert ask_http() == ("cloud", "hit", "cloud")
    assert ask_grpc() == ("cloud", "miss", "cloud")


def _admin_models(ops: str) -> set[str]:
    import urllib.request

    with urllib.request.urlopen(f"http://{ops}/admin/upstreams", timeout=5) as r:
        servers = json.loads(r.read())["servers"]
    return {m for s in servers for m, ready in s["models"].items() if ready}


def test_skewserve_up_runs_an_edge_tier_whose_cascades_end_at_the_stack(
    setup, cascade_repo: Path, tmp_path: Path
) -> None:
    """`skewserve up` with an `edge:` section: an edge site (its own Triton, its own gateway) in
    front of the stack's gateway; a cascade's `gateway: cloud` stage is the stack's gateway. A rule
    that keeps every answer is answered at the edge; one that keeps none, by the cloud model behind
    the stack's gateway, not marked offline. Rule paths are read from the stack file's folder."""
    _rule(tmp_path / "keep.json", [0.0] * CLASSES, 1)  # keeps every edge answer

    def cascade(name: str, rule: str) -> dict[str, Any]:
        return {
            "name": name,
            "stages": [
                {"name": "edge", "model": "edge", "rule": rule},
                {"name": "cloud", "model": "cloud", "gateway": "cloud"},
            ],
        }

    listen = {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "ops_port": 0}
    stack = {
        "repository": str(cascade_repo),
        "regions": {"cloud": 1},
        "gateway": {"listen": listen, "cache": {"backend": "none"}},
        "edge": {
            "servers": 1,
            "gateway": {
                "cache": {"backend": "none"},
                "cascades": [
                    cascade("digits-kept", "keep.json"),
                    cascade("digits-sent", str(setup["rules"] / "escalate.json")),
                ],
            },
        },
    }
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(yaml.safe_dump(stack))
    with cli_process("up", "--config", str(cfg), "--log-dir", str(tmp_path / "logs")) as proc:
        printed = " ".join(read_until(proc, "press Ctrl-C").split())
        assert "press Ctrl-C" in printed, printed
        edge = re.search(
            r"edge tier: cascades digits-kept, digits-sent at http://(\S+); .*ops: http://(\S+)/metrics",
            printed,
        )
        cloud_ops = re.search(r"gateway ops listener \(metrics, admin\): http://(\S+)/metrics", printed)
        assert edge and cloud_ops, printed
        wait_until(
            lambda: "cloud" in _admin_models(cloud_ops.group(1)), 60, "the stack's gateway serves cloud"
        )
        wait_until(lambda: "edge" in _admin_models(edge.group(2)), 60, "the edge gateway serves edge")
        row = setup["rows"][2]
        body, headers = _json_body(row)
        head, probabilities = _http_answer(*_post(edge.group(1), "digits-kept", body, headers))
        assert (head["model_name"], head["parameters"]["cascade_stage"]) == ("edge", "edge")
        np.testing.assert_allclose(probabilities, _direct(setup["triton"], "edge", row), rtol=1e-6)
        head, probabilities = _http_answer(*_post(edge.group(1), "digits-sent", body, headers))
        assert (head["model_name"], head["parameters"]["cascade_stage"]) == ("cloud", "cloud")
        assert head["parameters"]["cascade_offline"] is False
        np.testing.assert_allclose(probabilities, _direct(setup["triton"], "cloud", row), rtol=1e-6)


def test_a_cascade_refuses_a_version(setup) -> None:
    body, headers = _json_body(setup["rows"][0])
    conn = http.client.HTTPConnection(setup["gw"].http, timeout=30)
    try:
        conn.request("POST", "/v2/models/digits/versions/1/infer", body, headers)
        resp = conn.getresponse()
        assert resp.status == 400
        assert json.loads(resp.read())["error"] == (
            "'digits' is a cascade of ['edge', 'cloud']: it has no versions; send the request without one"
        )
    finally:
        conn.close()


def test_a_stage_behind_another_gateway_sends_its_key(setup) -> None:
    """`gateway.api_key_file` reaches the stage's requests as x-api-key; the answer is the cloud's."""
    body, headers = _json_body(setup["rows"][1])
    head, _ = _http_answer(*_post(setup["gw"].http, "digits-keyed", body, headers))
    assert (head["model_name"], head["parameters"]["cascade_stage"]) == ("cloud", "cloud")
    assert head["parameters"]["cascade_offline"] is False
    assert b"\r\nx-api-key: the-cloud-key\r\n" in bytes(setup["keyed"].sent).lower()


def test_a_stage_behind_a_tls_gateway_verifies_its_certificate_and_sends_its_key(setup) -> None:
    """`tls: true` with the cloud gateway's CA: both protocols reach it over TLS with the key it
    requires, and the answer is the cloud's; without that CA the certificate is not trusted, the
    stage fails and the edge's answer comes back marked offline (never a request sent in clear)."""
    row = setup["rows"][1]
    body, headers = _json_body(row)
    cloud = _direct(setup["triton"], "cloud", row)
    head, probabilities = _http_answer(*_post(setup["gw"].http, "digits-tls", body, headers))
    assert (head["model_name"], head["parameters"]["cascade_stage"]) == ("cloud", "cloud")
    assert head["parameters"]["cascade_offline"] is False
    np.testing.assert_allclose(probabilities, cloud, rtol=1e-6)
    resp, _ = _grpc(setup["gw"].grpc, "digits-tls", row)
    assert (_params(resp)["cascade_stage"], _params(resp)["cascade_offline"]) == ("cloud", False)
    np.testing.assert_allclose(_grpc_probabilities(resp), cloud, rtol=1e-6)

    head, _ = _http_answer(*_post(setup["gw"].http, "digits-tls-untrusted", body, headers))
    assert (head["model_name"], head["parameters"]["cascade_offline"]) == ("edge", True)
    resp, _ = _grpc(setup["gw"].grpc, "digits-tls-untrusted", row)
    assert (resp.model_name, _params(resp)["cascade_offline"]) == ("edge", True)

    host, port = setup["cloud_gw"].http.rsplit(":", 1)  # the key is what let the edge in
    conn = http.client.HTTPSConnection(
        host, int(port), context=ssl.create_default_context(cafile=str(setup["cloud_ca"])), timeout=30
    )
    try:
        conn.request("POST", "/v2/models/cloud/infer", body, headers)
        assert conn.getresponse().status == 401
    finally:
        conn.close()


@pytest.mark.parametrize(
    "stages,message",
    [
        (
            [{"name": "edge", "model": "edge"}, {"name": "cloud", "model": "cloud"}],
            "cascade 'c': stages ['edge'] have no rule; every stage but the last needs one",
        ),
        (
            [
                {"name": "edge", "model": "edge", "rule": "r.json"},
                {"name": "cloud", "model": "cloud", "rule": "r.json"},
            ],
            "cascade 'c': the last stage 'cloud' has a rule, but nothing comes after it; remove it",
        ),
        (
            [
                {"name": "edge", "model": "edge", "rule": "r.json"},
                {"name": "cloud", "model": "cloud", "region": "mars"},
            ],
            "cascades: stage 'cloud' of 'c' names region 'mars', which is not one of the regions ['near']",
        ),
        (
            [
                {"name": "edge", "model": "edge", "rule": "r.json"},
                {
                    "name": "cloud",
                    "model": "cloud",
                    "region": "near",
                    "gateway": {"http": "h:1", "grpc": "h:2"},
                },
            ],
            "stage 'cloud': region and gateway both set",
        ),
        *(
            (
                [
                    {"name": "edge", "model": "edge", "rule": "r.json"},
                    {"name": "cloud", "model": "cloud", "gateway": {"http": "h:1", "grpc": "h:2", **link}},
                ],
                message,
            )
            for link, message in (
                ({"api_key_file": "k"}, "api_key_file without tls would send the key in clear"),
                ({"tls": True, "plaintext": True}, "tls and plaintext both set"),
                ({"ca_file": "ca.pem"}, "ca_file and server_name apply to a TLS link"),
                (
                    {"tls": True, "ca_file": "/nonexistent/ca.pem"},
                    "ca_file '/nonexistent/ca.pem' does not exist",
                ),
                ({"tls": True, "ca_file": __file__}, "holds no PEM certificate"),
                ({"http": "https://h:1", "tls": False}, "an https:// address is a TLS link"),
            )
        ),
    ],
)
def test_a_cascade_config_that_cannot_work_is_refused_naming_the_field(stages, message: str) -> None:
    from gateway.config import ConfigError, load_gateway_config

    regions = [{"name": "near", "servers": [{"name": "a", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}]
    with pytest.raises(ConfigError) as exc:
        load_gateway_config(
            None, home_region="near", regions=regions, cascades=[{"name": "c", "stages": stages}]
        )
    assert message in str(exc.value)


def test_an_https_address_is_read_as_a_tls_link() -> None:
    from gateway.config import RemoteGatewayConfig

    link = RemoteGatewayConfig(http="https://cloud.example:443", grpc="https://cloud.example:8443")
    assert (link.http, link.grpc, link.tls) == ("cloud.example:443", "cloud.example:8443", True)


def test_an_edge_tier_refuses_gateway_cloud_to_a_stack_that_needs_a_key(tmp_path: Path) -> None:
    """`gateway: cloud` is a plain, keyless loopback link: a stack gateway with keys would refuse
    every escalation, so the stack file is refused at load, naming the setting."""
    from skewserve.stack import StackConfigError, load_stack_config

    stages = [
        {"name": "edge", "model": "e", "rule": "r.json"},
        {"name": "cloud", "model": "c", "gateway": "cloud"},
    ]
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "repository": str(tmp_path),
                "regions": {"r": 1},
                "gateway": {"auth": {"keys": [{"name": "k", "sha256": "a" * 64}]}},
                "edge": {"gateway": {"cascades": [{"name": "d", "stages": stages}]}},
            }
        )
    )
    with pytest.raises(
        StackConfigError, match=r"`gateway: cloud` reaches the stack's gateway in clear.*auth\.keys"
    ):
        load_stack_config(cfg)


def test_a_gateway_with_a_broken_rule_file_does_not_start(tmp_path: Path) -> None:
    """Checked where the config is loaded: exit 2 and one line naming the file, before listening."""
    import subprocess
    import sys

    import yaml

    rule = tmp_path / "rule.json"
    rule.write_text("{}")
    cfg = {
        "home_region": "near",
        "regions": [
            {"name": "near", "servers": [{"name": "a", "http": "127.0.0.1:1", "grpc": "127.0.0.1:2"}]}
        ],
        "cascades": [
            {
                "name": "c",
                "stages": [
                    {"name": "edge", "model": "e", "rule": str(rule)},
                    {"name": "cloud", "model": "k"},
                ],
            }
        ],
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"error: cascade rule {rule}: format must be 'skewserve.cascade-rule/1', got None; "
        "write it with `skewserve cascade calibrate`"
    )


def _cascade_samples(text: str, cascade: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, its labels but `cascade`) -> value, for one cascade's series in /metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("cascade") == cascade and not sample.name.endswith("_created"):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "cascade"))
                out[(sample.name, labels)] = sample.value
    return out


def test_metrics_count_what_the_requests_did(setup) -> None:
    """/metrics on the ops listener counts, item by item, what the requests did: answers per stage,
    judged items and escalations per predicted class of the edge, bytes sent to the cloud stage,
    stage calls by outcome; an unreachable cloud counts offline answers and the stage's failures."""
    gw, triton, rule = setup["gw"], setup["triton"], setup["split"]
    answers: dict[str, int] = {}
    judged: dict[str, int] = {}
    escalated: dict[str, int] = {}
    sent = 0
    for row in setup["rows"]:
        verdict = rule.judge(_direct(triton, "edge", row)[None, :])
        assert verdict is not None
        cls = rule.classes[verdict.classes[0]]
        judged[cls] = judged.get(cls, 0) + 1
        body, headers = _json_body(row)
        if not verdict.keep:
            escalated[cls] = escalated.get(cls, 0) + 1
            sent += len(body)
        expected = "edge" if verdict.keep else "cloud"
        head, _ = _http_answer(*_post(gw.http, "digits-metered", body, headers))
        assert head["parameters"]["cascade_stage"] == expected
        answers[expected] = answers.get(expected, 0) + 1
    got = _cascade_samples(gw.metrics(), "digits-metered")
    prefix = "skewserve_gateway_cascade_"
    counted = {k: v for k, v in got.items() if not k[0].startswith(prefix + "stage_seconds")}
    want = {
        **{
            (prefix + "answers_total", (("offline", "false"), ("stage", s))): float(n)
            for s, n in answers.items()
        },
        **{
            (prefix + "judged_items_total", (("class", c), ("stage", "edge"))): float(n)
            for c, n in judged.items()
        },
        **{
            (prefix + "escalations_total", (("class", c), ("stage", "edge"))): float(n)
            for c, n in escalated.items()
        },
        (prefix + "upstream_bytes_total", (("stage", "cloud"),)): float(sent),
    }
    assert counted == want
    calls = {"edge": len(setup["rows"]), "cloud": sum(escalated.values())}
    for stage, n in calls.items():
        key = (prefix + "stage_seconds_count", (("outcome", "answer"), ("stage", stage)))
        assert got[key] == n
    assert not any(dict(labels).get("outcome") == "failure" for _, labels in got)

    rows = setup["rows"][:3]  # over gRPC, to a cascade whose cloud nothing listens for
    sizes = 0
    for row in rows:
        resp, _ = _grpc(gw.grpc, "digits-metered-offline", row)
        assert _params(resp)["cascade_offline"] is True
        req = pb.ModelInferRequest(model_name="digits-metered-offline")
        req.inputs.add(name="features", datatype="FP32", shape=[1, 8])
        req.raw_input_contents.append(row.astype(np.float32).tobytes())
        sizes += len(req.SerializeToString())  # the bytes the gateway received, sent on to the cloud
    got = _cascade_samples(gw.metrics(), "digits-metered-offline")
    assert got[(prefix + "answers_total", (("offline", "true"), ("stage", "edge")))] == len(rows)
    assert got[(prefix + "stage_failures_total", (("stage", "cloud"),))] == len(rows)
    assert got[(prefix + "upstream_bytes_total", (("stage", "cloud"),))] == sizes
    assert got[(prefix + "stage_seconds_count", (("outcome", "failure"), ("stage", "cloud")))] == len(rows)
    assert sum(v for (name, _), v in got.items() if name == prefix + "escalations_total") == len(rows)


def test_a_client_accepting_gzip_gets_a_marked_answer_not_a_500(setup) -> None:
    """Found by review: a stage asked in the client's encoding answered gzip bytes the gateway
    could neither judge nor mark (a 500 for every python-requests client on an uncached path).
    Every stage is now asked in the identity encoding."""
    gw, rows = setup["gw"], setup["rows"]
    body, headers = _json_body(rows[0])
    status, answer_headers, raw = _post(gw.http, "digits", body, {**headers, "accept-encoding": "gzip"})
    head, _ = _http_answer(status, answer_headers, raw)
    assert head["parameters"]["cascade_stage"] in ("edge", "cloud")
    assert answer_headers.get("x-skewserve-cascade-offline") == "false"


def test_a_request_naming_only_logits_is_never_judged_on_them(setup) -> None:
    """Found by review: the rule read the only output when its own was not asked for, so logits
    were judged as probabilities and kept answers the rule escalates. It reads exactly its output:
    a request naming only `logits` escalates, every item."""
    gw, rows = setup["gw"], setup["rows"]
    stages = []
    for row in rows:
        body = {
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": row.tolist()}],
            "outputs": [{"name": "logits"}],
        }
        status, _, raw = _post(
            gw.http, "digits", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        assert status == 200, raw[:300]
        stages.append(json.loads(raw)["parameters"]["cascade_stage"])
    assert stages == ["cloud"] * len(rows)
