"""The gRPC front of the inference pipeline: a ModelInfer call read into a `Call`, and the
pipeline's answer (Triton's serialized response, forwarded as it came) or its refusal returned.

The message is parsed (upb, without touching tensor bytes) for the model, version, id and
parameters, checked against the gateway's limits, and forwarded as the client sent it; a version
chosen by the gateway (a model in canary) is appended as field 2, never re-encoded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from gateway.errors import BadRequest, GatewayError, grpc_code_for
from gateway.fleet.cascade import PARAMETERS, Mark
from gateway.fleet.dispatch import Attempt, SequenceId
from gateway.forward_headers import forwarded_metadata
from gateway.fronts.infer_body import MAX_UINT64, SHARED_MEMORY_PARAMETERS
from gateway.fronts.request_id import checked_request_id, is_valid_request_id, new_request_id
from gateway.pipeline import admission
from gateway.pipeline.answer_classes import grpc_classes, grpc_output
from gateway.pipeline.cache_alias import ExactAliases
from gateway.pipeline.call import Call
from gateway.pipeline.shadow_send import version_field
from gateway.state.cache import cache_key_async
from gateway.state.limits import client_address
from gateway.upstream.server import UpstreamServer

logger: Final = logging.getLogger(__name__)
# Above this many bytes a ModelInfer message is parsed, and re-serialised for the cache key, in a
# worker thread: upb parses ~1 GB/s, so the loop never holds more than ~0.25 ms of it.
OFF_LOOP_BYTES: Final = 256 * 1024
# Answers counted against a canary (the client's own mistakes are not the version's)
SERVER_FAULTS: Final = frozenset({"INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN"})


def _refuse_count(where: str, n: int, what: str, limit: int) -> None:
    raise BadRequest(f"{where} has {n} {what}, more than {limit} (limits.max_tensors); send at most {limit}")


def _check_tensor_counts(req: pb.ModelInferRequest, limit: int) -> None:
    """INVALID_ARGUMENT naming the field when a repeated field or map holds more than `limit` entries,
    and for shared-memory parameters (the gateway does not expose that extension).

    Each field of a parsed message read is an attribute lookup by name in protobuf's C code (about
    800 instructions): each is read once, and a tensor without parameters is not searched."""
    inputs, outputs = req.inputs, req.outputs
    if len(inputs) > limit:
        _refuse_count("the request", len(inputs), "inputs", limit)
    if len(outputs) > limit:
        _refuse_count("the request", len(outputs), "outputs", limit)
    n_params = len(req.parameters)
    if n_params > limit:
        _refuse_count("parameters", n_params, "entries", limit)
    n_raw = len(req.raw_input_contents)
    if n_raw > limit:
        _refuse_count("the request", n_raw, "raw_input_contents", limit)
    for section, tensors in (("inputs", inputs), ("outputs", outputs)):
        for n, tensor in enumerate(tensors):
            params = tensor.parameters
            if not params:
                continue
            if len(params) > limit:
                _refuse_count(f"{section}[{n}].parameters", len(params), "entries", limit)
            for name in SHARED_MEMORY_PARAMETERS:
                if name in params:
                    raise BadRequest(
                        f"{section}[{n}].parameters.{name}: the gateway does not expose Triton's "
                        "shared-memory extension; send tensor data in the request"
                    )


# Triton repeats a request's id and tensor names in its error messages, which travel back in the
# grpc-message trailer, percent-encoded (up to 3 bytes per byte); HAProxy refuses trailers beyond its
# buffer (tune.bufsize 32 KiB in gateway/upstream/haproxy.py) with a 502, which would count against a healthy
# server. These bounds keep the largest such message within it; real ids and names are far shorter.
MAX_ID_BYTES: Final = 8192
_SHARED_MEMORY_PREFIX: Final = b"shared_memory_"  # of every name in SHARED_MEMORY_PARAMETERS
MAX_NAME_BYTES: Final = 256


def _skeleton_bytes(req: pb.ModelInferRequest, size: int) -> int:
    """The bytes of a `size`-byte message outside its raw tensor contents: every entry of a repeated
    field or map, and every string but those contents, lies within them."""
    for contents in req.raw_input_contents:
        size -= len(contents)
    return size


def _may_break_tensor_limits(message: bytes, skeleton: int, limit: int) -> bool:
    """Whether _check_tensor_counts could refuse the message. Each entry of a repeated field or
    map takes at least two bytes of the skeleton (its key and length), and a shared-memory
    parameter's name is in the message as it is: where neither can be, the walk is skipped."""
    return skeleton > 2 * limit or _SHARED_MEMORY_PREFIX in message


def _check_echoed_lengths(req: pb.ModelInferRequest, skeleton: int | None = None) -> None:
    """`skeleton`: _skeleton_bytes of the message; when it fits the shortest bound, no string in it
    can exceed one, and nothing is walked."""
    if skeleton is not None and skeleton <= MAX_NAME_BYTES:
        return

    def refuse_long(where: str, text: str, limit: int) -> None:
        n = len(text.encode())
        if n > limit:
            raise BadRequest(f"{where} has {n} bytes, more than {limit}; send a shorter one")

    refuse_long("id", req.id, MAX_ID_BYTES)
    for section, tensors in (("inputs", req.inputs), ("outputs", req.outputs)):
        for n, tensor in enumerate(tensors):
            refuse_long(f"{section}[{n}].name", tensor.name, MAX_NAME_BYTES)
            for key in tensor.parameters:
                refuse_long(f"a key of {section}[{n}].parameters", key, MAX_NAME_BYTES)
    for key in req.parameters:
        refuse_long("a key of parameters", key, MAX_NAME_BYTES)


def _restamp(raw: bytes, request_id: str) -> bytes:
    resp = pb.ModelInferResponse.FromString(raw)
    if resp.id == request_id:
        return raw
    resp.id = request_id
    return resp.SerializeToString()


def model_field(model: str) -> bytes:
    """ModelInferRequest.model_name (field 1) as wire bytes: appended, it overrides the field (the
    last value of a scalar field wins), so a cascade's stage gets the client's bytes unchanged."""
    data = model.encode()
    return b"\x0a" + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mark_answer(raw: bytes, mark: Mark) -> bytes:
    """A serialized answer with a cascade's mark in its `parameters` (any mark it came with, from a
    gateway behind a stage, replaced)."""
    resp = pb.ModelInferResponse.FromString(raw)
    for name in PARAMETERS:
        if name in resp.parameters:
            del resp.parameters[name]
    for name, value in mark.parameters().items():
        param = resp.parameters[name]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value
    return resp.SerializeToString()


def mark_of(raw: bytes) -> Mark | None:
    try:
        resp = pb.ModelInferResponse.FromString(raw)
    except DecodeError:
        return None
    params = {}
    for name, param in resp.parameters.items():
        kind = param.WhichOneof("parameter_choice")
        params[name] = getattr(param, kind) if kind is not None else None
    return Mark.from_parameters(params)


def _timeout_us(req: pb.ModelInferRequest) -> int | None:
    """The `timeout` parameter in microseconds (int64 or uint64), None when absent."""
    if "timeout" not in req.parameters:
        return None
    param = req.parameters["timeout"]
    kind = param.WhichOneof("parameter_choice")
    if kind == "uint64_param":
        return min(param.uint64_param, MAX_UINT64)
    return param.int64_param


def _sequence_id(req: pb.ModelInferRequest) -> int | str | None:
    """Triton's correlation id (`sequence_id`, an integer or a string); None when absent or 0/""."""
    if "sequence_id" not in req.parameters:
        return None
    param = req.parameters["sequence_id"]
    kind = param.WhichOneof("parameter_choice")
    value: int | str | None = (
        param.int64_param
        if kind == "int64_param"
        else param.uint64_param
        if kind == "uint64_param"
        else param.string_param
        if kind == "string_param"
        else None
    )
    return value or None


class GrpcLimits:
    """The infer path's settings, read once from the config."""

    __slots__ = ("region_key", "sticky_key", "timeout_key", "max_batch", "max_tensors", "aliases")

    def __init__(self, cfg: Any) -> None:
        self.region_key: str = cfg.routing.region_header.lower()
        self.sticky_key: str = cfg.traffic.sticky_header.lower() if cfg.traffic else ""
        self.timeout_key: str = cfg.retries.timeout_header.lower()
        self.max_batch: int = cfg.limits.max_batch_size
        self.max_tensors: int = cfg.limits.max_tensors
        # Exact request bytes already keyed -> their key (gateway/pipeline/cache_alias.py).
        self.aliases: ExactAliases[bytes] = ExactAliases()


def grpc_call(
    gw: Any,
    limits: GrpcLimits,
    context: grpc.aio.ServicerContext,
    md: dict[str, str],
    started: float,
    model: str | None = None,
    version: str = "",
) -> Call:
    """A gRPC call as admission and the steps read it; `model` when the method's message named it
    ("" for the server: metadata, all-model statistics), else None until the message is read. A call through the bridge had its key
    checked, and its rate check started, from its headers (gateway/fronts/grpc_bridge.py)."""
    call = Call(
        "grpc",
        started,
        model or "",
        version,
        named=model is not None,
        pinned=md.get(limits.region_key),
        sticky=md.get(limits.sticky_key) if limits.sticky_key else None,
        timeout_ms=md.get(limits.timeout_key),
        call_remaining=context.time_remaining(),  # as `started` is read: see forward.plain_deadline
        passed_on=any(gw.forwarded(k) for k in md),
    )
    pre = getattr(context, "precheck", None)
    if pre is not None and pre.rate is not None:
        call.principal, call.caller, call.rate = pre.principal, pre.caller, pre.rate
        call.authenticated = True
    else:
        call.authorization, call.api_key = md.get("authorization"), md.get("x-api-key")
        call.client = client_address(context.peer())
    return call


class GrpcWire:
    """The pipeline's view of one ModelInfer call (gateway/pipeline/run.py `Wire`)."""

    cancelled = "CANCELLED"

    __slots__ = ("gw", "limits", "aliases", "context", "message", "metadata", "sent_id", "req", "answer")

    def __init__(
        self, gw: Any, limits: GrpcLimits, context: grpc.aio.ServicerContext, message: bytes
    ) -> None:
        self.gw = gw
        self.limits = limits
        self.aliases = limits.aliases
        self.context = context
        self.message = message
        self.metadata: dict[str, str] = {}
        self.sent_id: str | None = None
        self.req: pb.ModelInferRequest | None = None
        self.answer = b""

    def call(self, md: dict[str, str], started: float) -> Call:
        self.metadata = md
        self.sent_id = md.get("x-request-id")
        return grpc_call(self.gw, self.limits, self.context, md, started)

    # -- the pipeline's steps, gRPC's part -------------------------------------------------------
    def check_head(self, call: Call) -> None:
        if self.sent_id:
            call.request_id = checked_request_id(self.sent_id)

    async def read(self, call: Call) -> None:
        """The message's bytes count against its caller while it is handled; it is parsed for the
        model (an unknown key was refused before a byte of it was parsed)."""
        message = self.message
        admission.hold(self.gw, call, len(message))
        try:
            if len(message) > OFF_LOOP_BYTES:
                req = await asyncio.to_thread(pb.ModelInferRequest.FromString, message)
            else:
                req = pb.ModelInferRequest.FromString(message)
        except DecodeError as exc:
            raise BadRequest(f"malformed ModelInferRequest: {exc}") from None
        self.req = req
        call.model, call.version = req.model_name, req.model_version
        call.named = True
        # The protobuf `id` is Triton's to echo whatever it holds; it names the request in logs
        # and upstream metadata only when it is a valid metadata value.
        call.request_id = call.request_id or (req.id if is_valid_request_id(req.id) else new_request_id())

    def alias(self, call: Call, resolved: str, tenant: str) -> bytes | None:
        assert self.req is not None
        if self.req.id or len(self.message) >= OFF_LOOP_BYTES:
            return None
        limits = self.limits
        context = b"%s\0%s\0%d/%d\0%s" % (
            call.model.encode(),
            resolved.encode(),
            limits.max_batch,
            limits.max_tensors,
            tenant.encode(),
        )
        return self.aliases.name(context, self.message)

    @staticmethod
    def shared(stored: bytes) -> bytes:
        return _restamp(stored, "")

    async def parse(self, call: Call) -> GrpcInferRequest:
        req, limits = self.req, self.limits
        assert req is not None
        size = len(self.message)
        # Both checks below need only an upper bound of the skeleton: a small message is its own.
        skeleton = size if size <= MAX_NAME_BYTES else _skeleton_bytes(req, size)
        if _may_break_tensor_limits(self.message, skeleton, limits.max_tensors):
            _check_tensor_counts(req, limits.max_tensors)
        _check_echoed_lengths(req, skeleton)
        if limits.max_batch:
            for inp in req.inputs:
                shape = inp.shape
                if shape and shape[0] > limits.max_batch:
                    raise BadRequest(
                        f"input {inp.name!r} has batch size {inp.shape[0]}, above the gateway limit of {limits.max_batch}"
                    )
        call.call_remaining = self.context.time_remaining()  # now: admission may have waited
        passed_on = forwarded_metadata(self.metadata, self.gw.forwarded)
        bound = call.principal.headers if call.principal is not None else ()
        metadata = (("x-request-id", call.request_id), *passed_on, *bound)
        message = self.message if call.plan is None else self.message + version_field(call.version)
        return GrpcInferRequest(call, req, message, metadata)

    async def respond(self, call: Call, answer: bytes) -> None:
        call.status, call.ok = "OK", True
        trailing = [("x-request-id", call.request_id)]
        if call.cache_state is not None:
            trailing.append(("x-skewserve-cache", "hit" if call.cache_state == "hit" else "miss"))
        route = call.route
        if route is not None:
            trailing += [("x-skewserve-region", route.region), ("x-skewserve-server", route.server.name)]
        mark = call.mark if call.mark is not None or call.cascade is None else mark_of(answer)
        if mark is not None:
            trailing += mark.headers()
        self.context.set_trailing_metadata(tuple(trailing))
        self.answer = answer

    async def refuse(self, call: Call, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        if isinstance(exc, GatewayError):
            call.status = exc.grpc_code.name
            message = exc.message
            if exc.headers:
                self.context.set_trailing_metadata(
                    tuple((k, v) for k, v in exc.headers.items()) + (("x-request-id", call.request_id),)
                )
        else:
            call.status = "INTERNAL"
            logger.error("unhandled error in gRPC front, request_id=%s", call.request_id, exc_info=exc)
            message = f"internal gateway error; see the gateway log for request id {call.request_id}"
        call.ok = call.status not in SERVER_FAULTS
        await self.context.abort(grpc_code_for(exc), message)


class GrpcInferRequest:
    """A ModelInfer request as the pipeline's cache, dispatch and shadow steps use it."""

    __slots__ = ("call", "req", "message", "metadata", "size", "sequence_id", "timeout_us", "request_id")

    def __init__(
        self, call: Call, req: pb.ModelInferRequest, message: bytes, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self.call = call
        self.req = req
        self.message = message  # as the client sent it (plus the version the gateway chose)
        self.metadata = metadata
        self.size = len(message)
        # Most requests carry no parameters: then neither is looked up by name.
        has_parameters = len(req.parameters) > 0
        self.sequence_id: SequenceId = _sequence_id(req) if has_parameters else None
        self.timeout_us = _timeout_us(req) if has_parameters else None
        self.request_id = req.id

    def check(self) -> None:
        pass  # checked as it was parsed

    def cacheable(self) -> bool:
        return self.sequence_id is None

    async def cache_key(self, resolved: str, tenant: str) -> str:
        req = self.req
        req.id = ""
        req.model_version = ""
        if req.ByteSize() > OFF_LOOP_BYTES:
            material = await asyncio.to_thread(req.SerializeToString, deterministic=True)
        else:
            material = req.SerializeToString(deterministic=True)
        return await cache_key_async("grpc", self.call.model, resolved, material, tenant=tenant)

    def attempt(
        self,
        version: str | None = None,
        shared: bool = False,
        model: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Attempt[bytes]:
        message = self.message if version is None else self.message + version_field(version)
        if model is not None:  # a cascade's stage: the same request, to another model
            message += model_field(model)
        metadata = (*self.metadata, *headers)

        async def attempt(server: UpstreamServer, timeout_s: float) -> bytes:
            return await server.grpc_call("ModelInfer", message, timeout_s, metadata)

        return attempt

    @staticmethod
    def storable(raw: bytes, resolved: str | None) -> bytes | None:
        if resolved is None:
            return raw
        answered = pb.ModelInferResponse.FromString(raw).model_version
        return raw if answered == resolved else None

    @staticmethod
    def succeeded(raw: bytes) -> bool:
        return True  # Triton's refusals arrive as errors (UpstreamRejected)

    @staticmethod
    def output(raw: bytes, name: str) -> Any:
        return grpc_output(raw, name, exact=True)

    @staticmethod
    def marked(raw: bytes, mark: Mark) -> bytes:
        return mark_answer(raw, mark)

    @staticmethod
    def mark_of(raw: bytes) -> Mark | None:
        return mark_of(raw)

    @staticmethod
    def decode(stored: bytes) -> bytes:
        return stored

    def restamp(self, raw: bytes) -> bytes:
        return _restamp(raw, self.request_id)

    @staticmethod
    def classes(raw: bytes, output: str) -> list[str] | None:
        return grpc_classes(raw, output)
