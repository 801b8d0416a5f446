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

import asyncio
import json
import math
import urllib.parse
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
    try:
        req = pb.ModelInferRequest.FromString(message)
    except DecodeError:
        return None  # the fallback carries it, and Triton names what is wrong
    raw = req.raw_input_contents
    name = req.model_name
    if not name or urllib.parse.quote(name, safe="") != name or len(raw) != len(req.inputs):
        return None  # Triton's HTTP routes do not percent-decode: such a name goes by gRPC
    version = req.model_version
    if version and not (version.isascii() and version.isdigit()):
        return None  # no HTTP route matches: the gRPC front words the refusal
    if "\0" in req.id:
        return None
    inputs = []
    for tensor, data in zip(req.inputs, raw, strict=True):  # lengths checked above
        if tensor.parameters or tensor.HasField("contents") or any(d < 0 for d in tensor.shape):
            return None  # a negative dimension is INVALID_ARGUMENT over gRPC, INTERNAL over HTTP
        inputs.append(
            {
                "name": tensor.name,
                "datatype": tensor.datatype,
                "shape": list(tensor.shape),
                "parameters": {"binary_data_size": len(data)},
            }
        )
    head: dict[str, Any] = {"inputs": inputs}
    if req.outputs:
        outputs = []
        for out in req.outputs:
            spec: dict[str, Any] = {"name": out.name, "parameters": {"binary_data": True}}
            for key, param in out.parameters.items():
                if key != "classification" or param.WhichOneof("parameter_choice") != "int64_param":
                    return None
                if not 0 < param.int64_param < 2**32:
                    return None  # gRPC refuses <= 0 and reads the count as 32 bits; HTTP does neither
                spec["parameters"]["classification"] = param.int64_param
            outputs.append(spec)
        head["outputs"] = outputs
    params = _parameters(req.parameters)
    if params is None:
        return None
    if not req.outputs:
        params["binary_data_output"] = True  # every output, in binary, as gRPC answers them all
    head["parameters"] = params
    if req.id:
        head["id"] = req.id
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
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
        left = deadline - loop.time()
        if left <= 0:
            raise UpstreamTimeout(f"{self.address}: no response within {timeout_s:.3f}s")
        return await self.fallback.call(method, request, left, metadata)

    def describe(self) -> dict[str, int]:
        return {"over_http": self.over_http, "fallen_back": self.fallen_back, "asked_again": self.asked_again}

    async def close(self) -> None:
        await self.fallback.close()
