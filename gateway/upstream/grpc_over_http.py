"""gRPC ModelInfer carried to Triton's HTTP port as a binary-tensor request (listen.grpc_upstream:
http_binary): one HTTP/1.1 hop from the worker, instead of the relay's two HTTP/2 <-> HTTP/1.1
conversions in HAProxy.

Exact or not taken. A request goes over HTTP only when Triton's HTTP front reads it as its gRPC
front would (src/grpc/infer_handler.cc SetInferenceRequestMetadata against src/http_server.cc's
request parameters): raw input contents, no tensor parameters beyond a classification count,
request parameters whose types mean the same on both fronts, and no sequence (a stateful model is
never asked twice). Anything else goes by the fallback channel (the relay or grpc.aio), as does
any refusal: Triton's HTTP front maps several error kinds to one status, so a refused request is
asked again over gRPC for Triton's own code and words (refusals are made before the model runs;
an execution failure, HTTP 500, is INTERNAL on both fronts with the same words and is not asked
again). The answer is rebuilt as Triton's gRPC front builds it (InferResponseCompleteCommon):
id, name, version, parameters, outputs in order with their raw contents.
"""

from __future__ import annotations

import asyncio
import math
import urllib.parse
from collections.abc import Sequence
from typing import Any

import grpc
import orjson
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from gateway.errors import UpstreamRejected, UpstreamTimeout
from gateway.upstream.grpc_relay import GrpcChannel, RelayChannel
from gateway.upstream.http_client import HttpPool, HttpResponse

_HEADER_LENGTH = b"inference-header-content-length"
# Parameters each front reads itself, with the only type both read the same way; the `triton_`
# prefix and HTTP's own `binary_data_output` are never carried (gRPC passes the latter to the model).
_NON_NEGATIVE_INT = {"priority", "timeout"}


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
        return value if math.isfinite(value) else None
    return getattr(param, kind)  # int64, bool, string: the same custom parameter on both fronts


def _parameters(params: Any) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, param in params.items():
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
    if not req.model_name or len(raw) != len(req.inputs):
        return None
    inputs = []
    for tensor, data in zip(req.inputs, raw, strict=True):  # lengths checked above
        if tensor.parameters or tensor.HasField("contents"):
            return None
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
    path = b"/v2/models/" + urllib.parse.quote(req.model_name, safe="").encode()
    if req.model_version:
        path += b"/versions/" + urllib.parse.quote(req.model_version, safe="").encode()
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
    head = orjson.loads(body[:size])
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
        if value != value.strip(" \t"):
            return None
        headers.append((key.encode("ascii"), value.encode("ascii")))
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
        form = http_form(request)
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
        if resp.status == 500:  # the model failed: INTERNAL and the same words on the gRPC front
            self.over_http += 1
            raise UpstreamRejected(_error_text(resp), grpc_code=grpc.StatusCode.INTERNAL, http_status=500)
        if resp.status != 200:  # refused before the model ran: the gRPC front's code and words
            self.asked_again += 1
            left = deadline - loop.time()
            if left <= 0:
                raise UpstreamTimeout(f"{self.address}: no response within {timeout_s:.3f}s")
            return await self.fallback.call(method, request, left, metadata)
        self.over_http += 1
        try:
            return grpc_form(resp)
        except (ValueError, KeyError, TypeError) as exc:  # orjson's decode error is a ValueError
            # The model ran: not a server to retry on, an answer the gateway cannot pass on
            raise UpstreamRejected(
                f"{self.http.address}: an HTTP answer not in Triton's binary form ({exc})",
                grpc_code=grpc.StatusCode.INTERNAL,
                http_status=500,
            ) from exc

    def describe(self) -> dict[str, int]:
        return {"over_http": self.over_http, "fallen_back": self.fallen_back, "asked_again": self.asked_again}

    async def close(self) -> None:
        await self.fallback.close()
