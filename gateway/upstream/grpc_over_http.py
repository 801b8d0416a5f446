"""gRPC ModelInfer carried to Triton's HTTP port as a binary-tensor request (listen.grpc_upstream:
http_binary): one HTTP/1.1 hop from the worker, instead of the relay's two HTTP/2 <-> HTTP/1.1
conversions in HAProxy.

Exact or not taken. A request goes over HTTP only when Triton's HTTP front reads it as its gRPC
front would (src/grpc/infer_handler.cc SetInferenceRequestMetadata and grpc_utils.cc against
src/http_server.cc): raw input contents under a size read on the event loop, non-negative shapes,
no tensor parameters beyond a classification count gRPC reads alike, request parameters whose
types and values mean the same on both fronts (doubles only where rapidjson reads them exactly),
no sequence (a stateful model's step is never at risk), no NUL in what C strings carry, a model
name that needs no percent-encoding (Triton does not decode the path), and metadata that a header
carries as it is and that is not one of the headers framing the request. Anything else goes by
the fallback channel (the relay or grpc.aio).

A refusal is never asked again where the model may have run: HTTP's status is the error's kind
(500 INTERNAL, 404 NOT_FOUND, 503 UNAVAILABLE; 400 for INVALID_ARG and for UNKNOWN, ALREADY_EXISTS
and CANCELLED, which it folds together and which read as INVALID_ARGUMENT here), with the core's
words. Only 501 and the HTTP front's own statuses (before it read the request) are asked again
over gRPC: a decoupled model's refusal is worded per front. The answer is rebuilt as Triton's gRPC
front builds it (InferResponseCompleteCommon): id, name, version, parameters, outputs in order with
their raw contents.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, Final

import grpc
import orjson
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from gateway.errors import UpstreamRejected, UpstreamTimeout
from gateway.upstream.grpc_relay import GrpcChannel, RelayChannel, upstream_error
from gateway.upstream.http_client import HttpPool, HttpResponse
from gateway.upstream.model_infer_wire import read_plain

_HEADER_LENGTH: Final = b"inference-header-content-length"
# Larger messages are not parsed and copied on the event loop: the relay carries their bytes as
# they came.
MAX_CONVERTED_BYTES: Final = 256 * 1024
# Headers that frame the request Triton's HTTP front reads (or its answer): metadata of these names
# would change what it reads, so such a call goes by gRPC, where they are only metadata.
_FRAMING: Final = frozenset(
    {
        "content-type",
        "content-length",
        "content-encoding",
        "accept-encoding",
        "transfer-encoding",
        "host",
        "inference-header-content-length",
        "connection",
        "expect",
        "te",
        "trailer",
        "upgrade",
    }
)
# What HTTP's status says the error was, as the gRPC front would code it.
_CODES: Final = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
# Parameters each front reads itself, with the only type both read the same way; the `triton_`
# prefix and HTTP's own `binary_data_output` are never carried (gRPC passes the latter to the model).
_NON_NEGATIVE_INT: Final = {"priority", "timeout"}
# The answer's message written by hand (_plain_answer): one-byte values, and the field keys
# (field number << 3 | wire type 2) of ModelInferResponse.outputs (5), .raw_output_contents (6)
# and InferOutputTensor.shape (3).
_BYTES: Final = tuple(bytes([i]) for i in range(128))
_OUTPUT_KEY: Final = b"\x2a"
_CONTENTS_KEY: Final = b"\x32"
_SHAPE_KEY: Final = b"\x1a"
_INT64_RANGE: Final = 2**63
_UINT64_MASK: Final = 2**64 - 1
_NO_PARAMETERS: Final[dict[str, Any]] = {}
_NO_OUTPUTS: Final[list[Any]] = []
# A model name Triton's HTTP routes read as it is: what urllib.parse.quote(name, safe="") leaves
# unchanged (its always-safe set), the name not empty.
_ROUTE_NAME: Final = re.compile(r"[A-Za-z0-9_.~-]+")


def _parameter(key: str, param: pb.InferParameter) -> Any:
    """The JSON value Triton's HTTP front reads as the gRPC front reads `param`, or None."""
    kind = param.WhichOneof("parameter_choice")
    if key.startswith("triton_") or key == "binary_data_output" or kind is None or kind == "uint64_param":
        # priority as uint64 would read the same, but is rare enough not to be worth the branch
        return None
    if key in _NON_NEGATIVE_INT:
        return param.int64_param if kind == "int64_param" and param.int64_param >= 0 else None
    if key.startswith("sequence_"):
        return None  # a sequence's step runs once: never over a path that may ask it again
    if kind == "double_param":
        value = param.double_param
        return value if _exact_in_rapidjson(value) else None
    if kind == "string_param" and "\0" in param.string_param:
        return None  # C strings end there on both fronts, but the JSON reader's key lookups differ
    return getattr(param, kind)  # int64, bool, string: the same custom parameter on both fronts


def _exact_in_rapidjson(value: float) -> bool:
    """Whether Triton's JSON reader (rapidjson without full precision) reads the shortest decimal
    form of `value` back as exactly `value`: its fast path, at most 15 significant digits and a
    decimal exponent within 22 (larger ones may come back an ULP off)."""
    if not math.isfinite(value):
        return False
    _, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    return len(digits) <= 15 and isinstance(exponent, int) and -22 <= exponent <= 22


def _parameters(params: Any) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, param in params.items():
        if "\0" in key:
            return None  # the JSON reader's member names end at a NUL: another key, or none
        value = _parameter(key, param)
        if value is None:
            return None
        out[key] = value
    return out


def http_form(message: bytes) -> tuple[bytes, bytes, int] | None:
    """A ModelInfer request's (path, body, JSON header length) for Triton's HTTP front, or None
    where that front would not read it exactly as the gRPC one does."""
    plain = read_plain(message)
    if plain is None:
        return _http_form_by_protobuf(message)
    inputs = [(t.name, t.datatype, t.shape) for t in plain.inputs]
    outputs: list[dict[str, Any]] = [
        {"name": name, "parameters": {"binary_data": True}} for name in plain.outputs
    ]
    return _form(
        plain.model_name, plain.model_version, plain.id, inputs, outputs, {}, plain.raw_input_contents
    )


def _http_form_by_protobuf(message: bytes) -> tuple[bytes, bytes, int] | None:
    """http_form of any message: protobuf reads it (each field read once: every read of a parsed
    message's field is a lookup by name in protobuf's C code, about 800 instructions)."""
    try:
        req = pb.ModelInferRequest.FromString(message)
    except DecodeError:
        return None  # the fallback carries it, and Triton names what is wrong
    inputs = []
    for tensor in req.inputs:
        if tensor.parameters or tensor.HasField("contents"):
            return None
        inputs.append((tensor.name, tensor.datatype, list(tensor.shape)))
    outputs = []
    for out in req.outputs:
        spec: dict[str, Any] = {"name": out.name, "parameters": {"binary_data": True}}
        out_params = out.parameters
        if out_params:
            for key, param in out_params.items():
                if key != "classification" or param.WhichOneof("parameter_choice") != "int64_param":
                    return None
                count = param.int64_param
                if not 0 < count < 2**32:
                    return None  # gRPC refuses <= 0 and reads the count as 32 bits; HTTP does neither
                spec["parameters"]["classification"] = count
        outputs.append(spec)
    req_params = req.parameters
    params = _parameters(req_params) if req_params else {}
    if params is None:
        return None
    return _form(
        req.model_name, req.model_version, req.id, inputs, outputs, params, list(req.raw_input_contents)
    )


def _form(
    name: str,
    version: str,
    request_id: str,
    inputs: list[tuple[str, str, list[int]]],
    outputs: list[dict[str, Any]],
    params: dict[str, Any],
    raw: list[bytes],
) -> tuple[bytes, bytes, int] | None:
    if _ROUTE_NAME.fullmatch(name) is None or len(raw) != len(inputs):
        return None  # Triton's HTTP routes do not percent-decode: such a name goes by gRPC
    if version and not (version.isascii() and version.isdigit()):
        return None  # no HTTP route matches: the gRPC front words the refusal
    if "\0" in request_id:
        return None
    tensors = []
    for (tensor, datatype, shape), data in zip(inputs, raw, strict=True):  # lengths checked above
        if shape and min(shape) < 0:
            return None  # a negative dimension is INVALID_ARGUMENT over gRPC, INTERNAL over HTTP
        tensors.append(
            {
                "name": tensor,
                "datatype": datatype,
                "shape": shape,
                "parameters": {"binary_data_size": len(data)},
            }
        )
    head: dict[str, Any] = {"inputs": tensors}
    if outputs:
        head["outputs"] = outputs
    else:
        params["binary_data_output"] = True  # every output, in binary, as gRPC answers them all
    head["parameters"] = params
    if request_id:
        head["id"] = request_id
    path = b"/v2/models/" + name.encode()
    if version:
        path += b"/versions/" + version.encode()
    header = orjson.dumps(head)
    return path + b"/infer", header + b"".join(raw), len(header)


def _response_parameter(value: Any) -> pb.InferParameter:
    # bool before int: a JSON true is a Python bool, which is also an int
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    if isinstance(value, str):
        return pb.InferParameter(string_param=value)
    raise ValueError(f"a response parameter of JSON type {type(value).__name__}")


def grpc_form(resp: HttpResponse) -> bytes:
    """Triton's HTTP answer (200, binary outputs) as the ModelInferResponse its gRPC front sends;
    ValueError when the answer is not in that form."""
    length = resp.header(_HEADER_LENGTH)
    body = resp.body
    size = int(length) if length is not None else len(body)
    try:
        head = orjson.loads(body[:size])
    except orjson.JSONDecodeError:
        head = json.loads(body[:size])  # NaN or Infinity in a response parameter, as Triton writes them
    encoded = _plain_answer(head, body, size)
    return encoded if encoded is not None else _answer_by_protobuf(head, body, size)


def _answer_by_protobuf(head: Any, body: bytes, size: int) -> bytes:
    answer = pb.ModelInferResponse(
        model_name=head["model_name"], model_version=head["model_version"], id=head.get("id", "")
    )
    for key, value in head.get("parameters", {}).items():
        answer.parameters[key].CopyFrom(_response_parameter(value))
    offset = size
    for out in head.get("outputs", ()):
        params = dict(out.get("parameters", {}))
        n = params.pop("binary_data_size", None)
        if n is None or params or "data" in out:
            raise ValueError(f"output {out.get('name')!r} did not come back as binary data alone")
        tensor = answer.outputs.add(name=out["name"], datatype=out["datatype"])
        tensor.shape.extend(out["shape"])
        answer.raw_output_contents.append(body[offset : offset + n])
        offset += n
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} bytes beyond the outputs the header names")
    return answer.SerializeToString()


def _plain_answer(head: Any, body: bytes, size: int) -> bytes | None:
    """The answer's message written field by field as protobuf writes it (fields in number order,
    empty strings left out, shapes packed): what _answer_by_protobuf returns, at a fifth of its
    cost, for the common answer (string names, integer shapes, binary outputs, no parameters).
    None for anything else, which protobuf then writes or refuses."""
    if type(head) is not dict:
        return None
    name, version, request_id = head.get("model_name"), head.get("model_version"), head.get("id", "")
    parameters = head.get("parameters", _NO_PARAMETERS)
    outputs = head.get("outputs", _NO_OUTPUTS)
    if (
        type(name) is not str
        or type(version) is not str
        or type(request_id) is not str
        or type(parameters) is not dict
        or parameters
        or type(outputs) is not list
    ):
        return None
    parts = [_string(1, name), _string(2, version), _string(3, request_id)]
    contents = []
    offset = size
    for out in outputs:
        tensor = _plain_output(out)
        if tensor is None:
            return None
        n = out["parameters"]["binary_data_size"]
        if offset + n > len(body):
            return None
        parts += [_OUTPUT_KEY, _varint(len(tensor)), tensor]
        data = body[offset : offset + n]
        contents += [_CONTENTS_KEY, _varint(n), data]
        offset += n
    if offset != len(body):
        return None
    return b"".join(parts) + b"".join(contents)


def _plain_output(out: Any) -> bytes | None:
    """One output's InferOutputTensor, or None when it is not plain (see _plain_answer)."""
    if type(out) is not dict or "data" in out:
        return None
    params, name, datatype, shape = (
        out.get("parameters"),
        out.get("name"),
        out.get("datatype"),
        out.get("shape"),
    )
    if (
        type(params) is not dict
        or len(params) != 1
        or type(params.get("binary_data_size")) is not int
        or params["binary_data_size"] < 0
        or type(name) is not str
        or type(datatype) is not str
        or type(shape) is not list
    ):
        return None
    dims = []
    for d in shape:
        if type(d) is not int or not -_INT64_RANGE <= d < _INT64_RANGE:
            return None
        dims.append(_varint(d & _UINT64_MASK))
    packed = b"".join(dims)
    return (
        _string(1, name)
        + _string(2, datatype)
        + (_SHAPE_KEY + _varint(len(packed)) + packed if packed else b"")
    )


def _string(field: int, text: str) -> bytes:
    """A string field (wire type 2), or nothing for an empty one (proto3 leaves defaults out)."""
    if not text:
        return b""
    data = text.encode()
    return _BYTES[field << 3 | 2] + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _BYTES[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _exact_metadata(metadata: Sequence[tuple[str, str]]) -> list[tuple[bytes, bytes]] | None:
    """gRPC metadata as HTTP headers (Triton forwards either by its own pattern for the front),
    or None where a header would not carry the value as it is (HTTP trims surrounding whitespace)."""
    headers = []
    for key, value in metadata:
        if key in _FRAMING or value != value.strip(" \t") or not (key + value).isascii():
            return None
        headers.append((key.encode(), value.encode()))
    return headers


def _error_text(resp: HttpResponse) -> str:
    try:
        text = orjson.loads(resp.body)["error"]
    except (ValueError, KeyError, TypeError):
        text = None
    return text if isinstance(text, str) else resp.body.decode("utf-8", "replace")


class HttpBinaryChannel:
    """`GrpcChannel`'s interface for one Triton: ModelInfer over its HTTP port where that is exact,
    everything else by `fallback`. Counts the ModelInfer calls each way (/admin/upstreams)."""

    def __init__(self, http: HttpPool, fallback: GrpcChannel | RelayChannel) -> None:
        self.http = http
        self.fallback = fallback
        self.address = fallback.address
        self.over_http = 0
        self.fallen_back = 0
        self.asked_again = 0

    async def call(
        self, method: str, request: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]] = ()
    ) -> bytes:
        if method != "ModelInfer":  # metadata, readiness, statistics: the gRPC front's own answers
            return await self.fallback.call(method, request, timeout_s, metadata)
        form = http_form(request) if len(request) <= MAX_CONVERTED_BYTES else None
        headers = _exact_metadata(metadata) if form is not None else None
        if form is None or headers is None:
            self.fallen_back += 1
            return await self.fallback.call(method, request, timeout_s, metadata)
        path, body, header_length = form
        headers += [
            (b"content-type", b"application/octet-stream"),
            (b"inference-header-content-length", str(header_length).encode()),
        ]
        # The monotonic clock, read twice on one clock: asyncio.get_running_loop() makes a getpid
        # system call per call on Python 3.11.
        deadline = time.monotonic() + timeout_s
        resp = await self.http.request(b"POST", path, body, headers, timeout_s)
        if resp.status == 200:
            self.over_http += 1
            try:
                return grpc_form(resp)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON errors are ValueErrors
                # The model ran: not a server to retry on, an answer the gateway cannot pass on
                raise UpstreamRejected(
                    f"{self.http.address}: an HTTP answer not in Triton's binary form ({exc})",
                    grpc_code=grpc.StatusCode.INTERNAL,
                    http_status=500,
                ) from exc
        code = _CODES.get(resp.status)
        if code is not None:  # the error's kind and the core's words: never asked twice
            self.over_http += 1
            raise upstream_error(self.address, code, _error_text(resp))
        # 501 (a decoupled model's refusal, worded per front) or the HTTP front's own refusal
        # before it read the request: the gRPC front's code and words
        self.asked_again += 1
        left = deadline - time.monotonic()
        if left <= 0:
            raise UpstreamTimeout(f"{self.address}: no response within {timeout_s:.3f}s")
        return await self.fallback.call(method, request, left, metadata)

    def describe(self) -> dict[str, int]:
        return {"over_http": self.over_http, "fallen_back": self.fallen_back, "asked_again": self.asked_again}

    async def close(self) -> None:
        await self.fallback.close()
