"""listen.grpc_upstream http_binary (gateway/upstream/grpc_over_http.py): a gRPC ModelInfer carried
to Triton's HTTP port as a binary-tensor request gets the answer Triton's gRPC front gives, message
for message; a refusal gets that front's code and words; what HTTP would read differently goes by
the relay. Each against a real Triton, directly and through the gateway."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway
from tests.gateway.test_data_plane import INFER, infer_request
from tests.gateway.test_triton_parity import echo_triton as echo_triton  # noqa: F401 (a fixture)

OVER_HTTP = {"listen": {"grpc_upstream": "http_binary"}, "cache": {"backend": "none"}}


@pytest.fixture(scope="module")
def gw(
    one_triton: dict[str, list[TritonServer]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayUnderTest]:
    g = launch_gateway(gateway_config(one_triton, **OVER_HTTP), tmp_path_factory.mktemp("over_http_gw"))
    yield g
    g.stop()


def _call(
    address: str, req: pb.ModelInferRequest, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[str, Any]:
    """(code, answer bytes or the error's details)."""
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString)
        try:
            return "OK", stub(req, timeout=30, metadata=metadata or None)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()  # type: ignore[attr-defined]


def _both(
    triton: TritonServer, gw: GatewayUnderTest, req: pb.ModelInferRequest
) -> tuple[tuple[str, Any], tuple[str, Any]]:
    return _call(triton.grpc_address, req), _call(f"{gw.host}:{gw.grpc_port}", req)


def _carried(gw: GatewayUnderTest) -> dict[str, int]:
    totals = {"over_http": 0, "fallen_back": 0, "asked_again": 0}
    for server in gw.admin()["servers"]:
        for key, n in server["grpc_over_http"].items():
            totals[key] += n
    return totals


def _answered_requests() -> list[pb.ModelInferRequest]:
    two_rows = infer_request(rows=2)
    with_id = infer_request()
    with_id.id = "call-7"
    named = infer_request(rows=3)
    named.outputs.add(name="probabilities")
    top = infer_request(rows=2)
    top.outputs.add(name="probabilities").parameters["classification"].int64_param = 2
    custom = infer_request()
    custom.parameters["note"].string_param = "x"
    custom.parameters["weight"].double_param = 2.0
    custom.parameters["big"].int64_param = 2**40
    custom.parameters["flag"].bool_param = True
    custom.parameters["priority"].int64_param = 1
    pinned = infer_request()
    pinned.model_version = "1"
    return [infer_request(), two_rows, with_id, named, top, custom, pinned]


def test_an_infer_over_http_is_answered_as_tritons_grpc_front_answers_it(
    one_triton: dict[str, list[TritonServer]], gw: GatewayUnderTest
) -> None:
    triton = one_triton["us-east"][0]
    before = _carried(gw)
    requests = _answered_requests()
    for req in requests:
        direct, via = _both(triton, gw, req)
        assert direct[0] == via[0] == "OK", (direct, via)
        assert pb.ModelInferResponse.FromString(via[1]) == pb.ModelInferResponse.FromString(direct[1])
        assert via[1] == direct[1]  # byte for byte: no parameter maps whose order could differ
    after = _carried(gw)
    assert after["over_http"] - before["over_http"] == len(requests)
    assert after["fallen_back"] == before["fallen_back"] and after["asked_again"] == before["asked_again"]


def _refused_requests() -> list[pb.ModelInferRequest]:
    wrong_name = infer_request()
    wrong_name.inputs[0].name = "nope"
    wrong_shape = infer_request()
    wrong_shape.inputs[0].shape[1] = 7
    short = infer_request()
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    no_output = infer_request()
    no_output.outputs.add(name="nothing")
    reserved = infer_request()
    reserved.parameters["binary_data_output"].bool_param = True  # HTTP's own: gRPC hands it to the model
    return [wrong_name, wrong_shape, short, no_output, reserved]


def test_a_refusal_has_the_grpc_fronts_code_and_words(
    one_triton: dict[str, list[TritonServer]], gw: GatewayUnderTest
) -> None:
    triton = one_triton["us-east"][0]
    for req in _refused_requests():
        before = _carried(gw)
        direct, via = _both(triton, gw, req)
        assert via == direct, (direct, via)
        after = _carried(gw)
        # Refused over HTTP, then asked again over gRPC; or sent there at once (HTTP's own parameter)
        moved = {k: after[k] - before[k] for k in after}
        assert (
            moved == {"over_http": 0, "fallen_back": 0, "asked_again": 1}
            if direct[0] != "OK"
            else {"over_http": 0, "fallen_back": 1, "asked_again": 0}
        ), (moved, direct)
    assert all(s["failures"] == 0 for s in gw.admin()["servers"])  # no server was blamed


def test_what_http_would_read_differently_goes_by_the_relay(
    one_triton: dict[str, list[TritonServer]], gw: GatewayUnderTest
) -> None:
    typed = pb.ModelInferRequest(model_name="lt")
    typed.inputs.add(name="features", datatype="FP32", shape=[1, 8]).contents.fp32_contents.extend([0.5] * 8)
    unsigned = infer_request()
    unsigned.parameters["count"].uint64_param = 3  # an error on the gRPC front, a number over HTTP
    sequence = infer_request()
    sequence.parameters["sequence_id"].int64_param = 5  # a sequence's step is never asked twice
    reserved = infer_request()
    reserved.parameters["triton_enable_empty_final_response"].bool_param = True
    triton = one_triton["us-east"][0]
    before = _carried(gw)
    for req in (typed, unsigned, sequence, reserved):
        direct, via = _both(triton, gw, req)
        assert via == direct, (direct, via)
    after = _carried(gw)
    assert after["fallen_back"] - before["fallen_back"] == 4 and after["over_http"] == before["over_http"]


def _echoed(address: str, req: pb.ModelInferRequest, metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    code, answer = _call(address, req, metadata)
    assert code == "OK", answer
    raw = pb.ModelInferResponse.FromString(answer).raw_output_contents[0]
    return json.loads(raw[4 : 4 + int.from_bytes(raw[:4], "little")])  # type: ignore[no-any-return]


def test_the_model_sees_the_same_parameters_and_forwarded_headers(
    echo_triton: dict[str, list[TritonServer]],
    make_gateway: Callable[..., GatewayUnderTest],  # noqa: F811
) -> None:
    gw = make_gateway(
        gateway_config(echo_triton, **OVER_HTTP, routing={"header_forward_pattern": "x-tenant-id"})
    )
    req = pb.ModelInferRequest(model_name="echo_params")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    req.raw_input_contents.append(b"\0" * 16)
    req.parameters["note"].string_param = "x"
    req.parameters["weight"].double_param = 2.0
    req.parameters["big"].int64_param = 2**40
    req.parameters["flag"].bool_param = False
    metadata = (("x-tenant-id", "acme"),)
    direct = _echoed(echo_triton["us-east"][0].grpc_address, req, metadata)
    via = _echoed(f"{gw.host}:{gw.grpc_port}", req, metadata)
    mine = ("note", "weight", "big", "flag", "x-tenant-id")
    assert {k: via.get(k) for k in mine} == {k: direct.get(k) for k in mine}
    assert {type(via[k]) for k in ("weight", "big")} == {float, int}
    assert _carried(gw)["over_http"] == 1
