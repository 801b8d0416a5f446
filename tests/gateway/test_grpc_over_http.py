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

from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer
from tests.gateway.conftest import GatewayUnderTest, gateway_config, launch_gateway, start_fleet, stop_fleet
from tests.gateway.protocol_models import python_model_repo
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


def test_a_refusal_has_the_grpc_fronts_code_and_words_and_is_never_asked_twice(
    one_triton: dict[str, list[TritonServer]], gw: GatewayUnderTest
) -> None:
    triton = one_triton["us-east"][0]
    for req in _refused_requests():
        before = _carried(gw)
        direct, via = _both(triton, gw, req)
        assert via == direct, (direct, via)
        after = _carried(gw)
        moved = {k: after[k] - before[k] for k in after}
        # Refused over HTTP, answered from HTTP's status and the core's words; or sent by gRPC at
        # once (HTTP's own parameter, which gRPC hands to the model)
        expected = {"over_http": 1, "fallen_back": 0, "asked_again": 0}
        if direct[0] == "OK":
            expected = {"over_http": 0, "fallen_back": 1, "asked_again": 0}
        assert moved == expected, (moved, direct)
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
    negative = infer_request()
    negative.inputs[0].shape[0] = -1  # INVALID_ARGUMENT over gRPC, a JSON error (INTERNAL) over HTTP
    no_classes = infer_request()
    no_classes.outputs.add(name="probabilities").parameters["classification"].int64_param = 0
    nul_key = infer_request()
    nul_key.parameters["priority\0x"].int64_param = 1
    inexact = infer_request()
    inexact.parameters["weight"].double_param = 0.9210986675838745  # 16 digits: rapidjson may miss it
    cases = (typed, unsigned, sequence, reserved, negative, no_classes, nul_key, inexact)
    triton = one_triton["us-east"][0]
    before = _carried(gw)
    for req in cases:
        direct, via = _both(triton, gw, req)
        assert via == direct, (direct, via)
    after = _carried(gw)
    assert after["fallen_back"] - before["fallen_back"] == len(cases)
    assert after["over_http"] == before["over_http"]
    assert all(s["failures"] == 0 for s in gw.admin()["servers"])


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
        gateway_config(
            echo_triton, **OVER_HTTP, routing={"header_forward_pattern": "x-tenant-id|accept-encoding"}
        )
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
    # Metadata naming a header that frames Triton's HTTP request (here: a compressed answer the
    # gateway would then have to read) is gRPC metadata only: that call goes by gRPC.
    framing = (("x-tenant-id", "acme"), ("accept-encoding", "gzip"))
    assert _echoed(f"{gw.host}:{gw.grpc_port}", req, framing)["x-tenant-id"] == "acme"
    assert _carried(gw) == {"over_http": 1, "fallen_back": 1, "asked_again": 0}


COUNTED_CONFIG = """
name: "refuses_counted"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
COUNTED_PY = """
import os
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = os.path.join(args["model_repository"], "runs.log")

    def execute(self, requests):
        with open(self.runs, "a") as runs:
            runs.write("run\\n" * len(requests))
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("refused by the model", pb_utils.TritonError.UNKNOWN)) for _ in requests]
"""


@pytest.fixture(scope="module")
def counted_triton(
    tmp_path_factory: pytest.TempPathFactory, prepared_triton: PreparedTriton
) -> Iterator[dict[str, list[TritonServer]]]:
    repo = python_model_repo(
        tmp_path_factory.mktemp("counted_repo"), {"refuses_counted": (COUNTED_CONFIG, COUNTED_PY)}
    )
    f = start_fleet(repo, {"us-east": 1}, tmp_path_factory.mktemp("counted_logs"), prepared_triton)
    yield f
    stop_fleet(f)


def test_a_models_own_error_is_passed_on_with_its_words_and_the_model_runs_once(
    counted_triton: dict[str, list[TritonServer]], make_gateway: Callable[..., GatewayUnderTest]
) -> None:
    """HTTP folds the error kinds UNKNOWN (here a Python model's), ALREADY_EXISTS and CANCELLED
    into INVALID_ARG's 400: they read as INVALID_ARGUMENT, never as a reason to ask again."""
    gw = make_gateway(gateway_config(counted_triton, **OVER_HTTP, retries={"max_attempts": 1}))
    triton = counted_triton["us-east"][0]
    runs = triton.spec.repository / "refuses_counted" / "runs.log"
    req = pb.ModelInferRequest(model_name="refuses_counted")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
    req.raw_input_contents.append(b"\0" * 16)
    direct = _call(triton.grpc_address, req)
    assert runs.read_text().count("run") == 1
    via = _call(f"{gw.host}:{gw.grpc_port}", req)
    assert via == ("INVALID_ARGUMENT", direct[1]) and direct[0] == "UNKNOWN"
    assert runs.read_text().count("run") == 2  # once for the gateway's call: never asked again
    assert _carried(gw) == {"over_http": 1, "fallen_back": 0, "asked_again": 0}


def test_what_the_http_form_refuses_to_carry() -> None:
    """Units of the same rules, each a request the relay carries instead (None)."""
    from gateway.upstream.grpc_over_http import http_form

    def with_(change: Callable[[pb.ModelInferRequest], object]) -> bytes:
        req = infer_request()
        change(req)
        return req.SerializeToString()

    assert http_form(infer_request().SerializeToString()) is not None
    assert http_form(b"\xff\xff not a message") is None
    refused = {
        "a name Triton's routes would not decode": lambda r: setattr(r, "model_name", "l t"),
        "a version no route matches": lambda r: setattr(r, "model_version", "-1"),
        "typed contents": lambda r: r.inputs[0].contents.fp32_contents.append(1.0),
        "a tensor parameter": lambda r: (
            r.inputs[0].parameters["shared_memory_region"].MergeFrom(pb.InferParameter(string_param="r"))
        ),
        "a classification count gRPC reads as 32 bits": lambda r: (
            r.outputs.add(name="p")
            .parameters["classification"]
            .MergeFrom(pb.InferParameter(int64_param=2**32))
        ),
        "a NUL in the id": lambda r: setattr(r, "id", "a\0b"),
        "a NUL in a string parameter": lambda r: r.parameters["s"].MergeFrom(
            pb.InferParameter(string_param="a\0")
        ),
        "an infinite double": lambda r: r.parameters["d"].MergeFrom(
            pb.InferParameter(double_param=float("inf"))
        ),
        "a tiny double": lambda r: r.parameters["d"].MergeFrom(pb.InferParameter(double_param=1.5e-30)),
        "a negative timeout": lambda r: r.parameters["timeout"].MergeFrom(pb.InferParameter(int64_param=-1)),
        "a string sequence id": lambda r: r.parameters["sequence_id"].MergeFrom(
            pb.InferParameter(string_param="s")
        ),
    }
    carried = [why for why, change in refused.items() if http_form(with_(change)) is not None]
    assert carried == []
    exact = with_(lambda r: r.parameters["d"].MergeFrom(pb.InferParameter(double_param=0.25)))
    assert http_form(exact) is not None


def test_an_answer_with_a_nan_parameter_is_rebuilt() -> None:
    from gateway.upstream.grpc_over_http import grpc_form
    from gateway.upstream.http_client import HttpResponse

    head = b'{"model_name":"m","model_version":"1","parameters":{"x":NaN},"outputs":[]}'
    answer = pb.ModelInferResponse.FromString(
        grpc_form(HttpResponse(200, [(b"Inference-Header-Content-Length", str(len(head)).encode())], head))
    )
    assert (
        answer.model_name == "m"
        and answer.parameters["x"].double_param != answer.parameters["x"].double_param
    )


def _plain_requests() -> list[pb.ModelInferRequest]:
    """Requests of the plain shape and just beyond it, for the wire reader against protobuf."""
    out = [pb.ModelInferRequest(), infer_request()]
    for n, (name, version, request_id) in enumerate(
        [("m", "", ""), ("model_1.v-2~x", "12", "req-1"), ("modèle", "1", "ïd"), ("a" * 200, "0", "x" * 300)]
    ):
        req = pb.ModelInferRequest(model_name=name, model_version=version, id=request_id)
        for i in range(n + 1):
            req.inputs.add(name=f"in{i}", datatype="FP32", shape=[1, 2**40, 0][: i + 1])
            req.raw_input_contents.append(bytes(range(i * 70 % 256)) * (i + 1))
        for i in range(n):
            req.outputs.add(name=f"out{i}")
        out.append(req)
    negative = infer_request()
    negative.inputs[0].shape[1] = -1
    extremes = infer_request()
    extremes.inputs[0].shape.extend([-(2**63), 2**63 - 1])
    more_raw = infer_request()
    more_raw.raw_input_contents.append(b"\0" * 4)
    classified = infer_request()
    classified.outputs.add(name="p").parameters["classification"].int64_param = 3
    with_parameter = infer_request()
    with_parameter.parameters["priority"].int64_param = 2
    contents = infer_request()
    contents.inputs[0].contents.fp32_contents.append(1.0)
    tensor_parameter = infer_request()
    tensor_parameter.inputs[0].parameters["x"].bool_param = True
    return [*out, negative, extremes, more_raw, classified, with_parameter, contents, tensor_parameter]


def test_the_wire_reader_reads_every_message_as_protobuf_does_or_leaves_it_to_protobuf() -> None:
    """gateway/upstream/model_infer_wire.py reads the plain shape without protobuf's Python API: on
    valid messages, on every one-byte change, cut and insertion of them, its reading (where it
    gives one) is protobuf's, and the HTTP form built from it is the one built from protobuf's."""
    from google.protobuf.message import DecodeError

    from gateway.upstream.grpc_over_http import _http_form_by_protobuf, http_form
    from gateway.upstream.model_infer_wire import read_plain

    def agrees(message: bytes) -> bool:
        plain = read_plain(message)
        assert http_form(message) == _http_form_by_protobuf(message), message.hex()
        if plain is None:
            return False
        try:
            req = pb.ModelInferRequest.FromString(message)
        except DecodeError:
            raise AssertionError(f"read a message protobuf refuses: {message.hex()}") from None
        assert (plain.model_name, plain.model_version, plain.id) == (
            req.model_name,
            req.model_version,
            req.id,
        )
        assert [(t.name, t.datatype, t.shape) for t in plain.inputs] == [
            (t.name, t.datatype, list(t.shape)) for t in req.inputs
        ]
        assert not any(t.parameters or t.HasField("contents") for t in req.inputs)
        assert plain.outputs == [o.name for o in req.outputs] and not any(o.parameters for o in req.outputs)
        assert plain.raw_input_contents == list(req.raw_input_contents) and not req.parameters
        return True

    read = 0
    for req in _plain_requests():
        message = req.SerializeToString()
        plain = not (
            req.parameters or any(t.parameters or t.HasField("contents") for t in req.inputs)
        ) and not any(o.parameters for o in req.outputs)
        assert agrees(message) == plain, req
        for at in range(0, len(message), max(1, len(message) // 60)):
            for changed in (
                message[:at] + bytes([message[at] ^ 0x01]) + message[at + 1 :],
                message[:at] + bytes([message[at] | 0x80]) + message[at + 1 :],
                message[:at] + bytes([0xFF]) + message[at + 1 :],
                message[:at],
                message[:at] + b"\x0a\x01a" + message[at:],
                message[:at] + b"\x18\x01" + message[at:],
            ):
                read += agrees(changed)
    assert read > 100  # the mutations kept many messages plain, so both readers were compared on them

    named_twice = (
        infer_request().SerializeToString() + pb.ModelInferRequest(model_name="b").SerializeToString()
    )
    unpacked_shape = bytes.fromhex(
        "2a0a0a01781204465033321801"
    )  # inputs { name: "x" datatype: "FP32" shape: 1 }
    not_utf8 = b"\x0a\x02\xc3\x28"
    unknown_field = infer_request().SerializeToString() + b"\x40\x01"
    for message in (named_twice, unpacked_shape, not_utf8, unknown_field):
        assert read_plain(message) is None
        assert http_form(message) == _http_form_by_protobuf(message)


def test_the_answer_written_by_hand_is_the_one_protobuf_writes() -> None:
    """grpc_form writes a plain answer field by field: byte for byte what protobuf writes, which
    still writes (or refuses) every other answer."""
    from gateway.upstream.grpc_over_http import _answer_by_protobuf, _plain_answer

    def head_of(**fields: Any) -> dict[str, Any]:
        return {"model_name": "m", "model_version": "1", **fields}

    def output(name: str, shape: list[Any], size: int, **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "datatype": "FP32",
            "shape": shape,
            "parameters": {"binary_data_size": size},
            **extra,
        }

    plain = [
        (head_of(outputs=[]), b""),
        (head_of(id="", outputs=[output("p", [1, 4], 16)]), bytes(range(16))),
        (
            head_of(
                model_version="",
                id="réq",
                outputs=[output("", [], 0), output("ü" * 70, [-1, 2**63 - 1, 0], 300)],
            ),
            b"\x01" * 300,
        ),
        ({"model_name": "m" * 200, "model_version": "12", "parameters": {}}, b""),
    ]
    for head, data in plain:
        body = json.dumps(head).encode() + data
        size = len(body) - len(data)
        encoded = _plain_answer(head, body, size)
        assert encoded is not None and encoded == _answer_by_protobuf(head, body, size), head
    not_plain = [
        (head_of(parameters={"x": 1}, outputs=[]), b""),
        (head_of(outputs=[output("p", [1.0], 4)]), b"\0" * 4),
        (head_of(outputs=[output("p", [True], 4)]), b"\0" * 4),
        (head_of(outputs=[output("p", [2**63], 4)]), b"\0" * 4),
        (head_of(outputs=[output("p", [1], 4, data=[1])]), b"\0" * 4),
        (head_of(outputs=[output("p", [1], 8)]), b"\0" * 4),
        (head_of(outputs=[output("p", [1], 2)]), b"\0" * 4),
        (head_of(id=7, outputs=[]), b""),
        ({"model_version": "1"}, b""),
    ]
    for head, data in not_plain:
        body = json.dumps(head).encode() + data
        assert _plain_answer(head, body, len(body) - len(data)) is None, head


def test_a_message_that_could_break_a_tensor_limit_is_walked() -> None:
    """The walk over a message's tensors is skipped only where no limit can be broken: a message
    one entry over the limit in any repeated field or map, however small its entries, is walked."""
    from gateway.fronts.grpc_infer import _may_break_tensor_limits, _skeleton_bytes

    limit = 3

    def over(change: Callable[[pb.ModelInferRequest], object]) -> bool:
        req = pb.ModelInferRequest()
        change(req)
        message = req.SerializeToString()
        return _may_break_tensor_limits(message, _skeleton_bytes(req, len(message)), limit)

    one_over = {
        "inputs": lambda r: [r.inputs.add() for _ in range(limit + 1)],
        "outputs": lambda r: [r.outputs.add() for _ in range(limit + 1)],
        "raw contents": lambda r: r.raw_input_contents.extend([b"x" * 100] * (limit + 1)),
        "parameters": lambda r: [
            r.parameters[str(n)].MergeFrom(pb.InferParameter()) for n in range(limit + 1)
        ],
        "a tensor's parameters": lambda r: [
            r.inputs.add().parameters[str(n)].MergeFrom(pb.InferParameter()) for n in range(limit + 1)
        ],
        "a shared-memory parameter": lambda r: (
            r.outputs.add().parameters["shared_memory_offset"].MergeFrom(pb.InferParameter(int64_param=0))
        ),
    }
    assert [why for why, change in one_over.items() if not over(change)] == []
    # A common request under the default limit (256) is not walked, whatever its tensors' bytes.
    req = infer_request(rows=1000)
    message = req.SerializeToString()
    assert not _may_break_tensor_limits(message, _skeleton_bytes(req, len(message)), 256)
