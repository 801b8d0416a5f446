"""`inference.GRPCInferenceService` front: the gateway's gRPC methods, carried either by the HAProxy
data plane (gateway/grpc_bridge.py, the default) or by grpc.aio in the gateway's event loop.

Generic handlers take and return raw bytes: ModelInfer requests are parsed only for the model name
and version (upb does this without touching tensor bytes) and forwarded as the client sent them.
Only the health, metadata, config, statistics and infer methods are registered; the repository,
shared-memory, trace and logging methods answer UNIMPLEMENTED, as for any method a server does not have.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2 as pb

from gateway.cache import cache_key_async
from gateway.cache_alias import ExactAliases
from gateway.config import TlsConfig
from gateway.core import Gateway
from gateway.dispatch import Attempt
from gateway.errors import BadRequest, GatewayError, grpc_code_for
from gateway.grpc_bridge import Precheck
from gateway.haproxy import PEER_HEADER
from gateway.infer_body import MAX_UINT64, SHARED_MEMORY_PARAMETERS
from gateway.limits import client_address
from gateway.listen import check_free, refused
from gateway.request_id import checked_request_id, is_valid_request_id, new_request_id
from gateway.shadow_send import offer_grpc, version_field
from gateway.statistics import (
    SERVER_HEADER,
    gather_statistics,
    merge_statistics,
    only_allowed,
    statistics_servers,
)
from gateway.traffic import Plan, Traffic
from gateway.traffic_tally import Role
from gateway.upstream import UpstreamServer

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
SERVICE = "inference.GRPCInferenceService"
_FORWARD_METADATA = ("x-request-id",)
# Above this many bytes a ModelInfer message is parsed, and re-serialised for the cache key, in a
# worker thread: upb parses ~1 GB/s, so the loop never holds more than ~0.25 ms of it.
OFF_LOOP_BYTES = 256 * 1024


# Answers counted against a canary (the client's own mistakes are not the version's)
_SERVER_FAULTS = frozenset({"INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN"})

# Methods that answer without a key, as Triton's health endpoints do.
UNKEYED_METHODS = frozenset({"ServerLive", "ServerReady"})


def _check_tensor_counts(req: pb.ModelInferRequest, limit: int) -> None:
    """INVALID_ARGUMENT naming the field when a repeated field or map holds more than `limit` entries,
    and for shared-memory parameters (the gateway does not expose that extension)."""

    def refuse(where: str, n: int, what: str) -> None:
        raise BadRequest(
            f"{where} has {n} {what}, more than {limit} (limits.max_tensors); send at most {limit}"
        )

    if len(req.inputs) > limit:
        refuse("the request", len(req.inputs), "inputs")
    if len(req.outputs) > limit:
        refuse("the request", len(req.outputs), "outputs")
    if len(req.parameters) > limit:
        refuse("parameters", len(req.parameters), "entries")
    if len(req.raw_input_contents) > limit:
        refuse("the request", len(req.raw_input_contents), "raw_input_contents")
    for section, tensors in (("inputs", req.inputs), ("outputs", req.outputs)):
        for n, tensor in enumerate(tensors):
            params = tensor.parameters
            if len(params) > limit:
                refuse(f"{section}[{n}].parameters", len(params), "entries")
            for name in SHARED_MEMORY_PARAMETERS:
                if name in params:
                    raise BadRequest(
                        f"{section}[{n}].parameters.{name}: the gateway does not expose Triton's "
                        "shared-memory extension; send tensor data in the request"
                    )


# Triton repeats a request's id and tensor names in its error messages, which travel back in the
# grpc-message trailer, percent-encoded (up to 3 bytes per byte); HAProxy refuses trailers beyond its
# buffer (tune.bufsize 32 KiB in gateway/haproxy.py) with a 502, which would count against a healthy
# server. These bounds keep the largest such message within it; real ids and names are far shorter.
MAX_ID_BYTES = 8192
MAX_NAME_BYTES = 256


def _check_echoed_lengths(req: pb.ModelInferRequest) -> None:
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


class GrpcFront:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        cfg = gateway.cfg
        self.region_key = cfg.routing.region_header.lower()
        self.sticky_key = cfg.traffic.sticky_header.lower() if cfg.traffic else ""
        self.timeout_key = cfg.retries.timeout_header.lower()
        self.max_batch = cfg.limits.max_batch_size
        self.max_tensors = cfg.limits.max_tensors
        # Exact request bytes already keyed -> their key (gateway/cache_alias.py).
        self.aliases: ExactAliases[bytes] = ExactAliases()
        self.server: grpc.aio.Server | None = None

    def methods(self) -> dict[str, Any]:
        """The served methods by name: everything else is UNIMPLEMENTED, as on a server without it."""
        return {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "ModelInfer": self.model_infer,
        }

    def handlers(self) -> grpc.GenericRpcHandler:
        def raw(fn: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=None, response_serializer=None
            )

        return grpc.method_handlers_generic_handler(
            SERVICE, {name: raw(fn) for name, fn in self.methods().items()}
        )

    async def start(
        self,
        host: str,
        port: int,
        tls: TlsConfig | None = None,
        extra: Sequence[grpc.GenericRpcHandler] = (),
    ) -> int:
        """Bind and serve (over TLS with `tls`), with `extra` handlers (streams) beside the unary
        methods; ListenError names listen.grpc_port when taken."""
        # grpc reports a failed bind only as port 0, after logging its own lines: check first.
        check_free(host, port, "grpc_port")
        options = [
            ("grpc.max_receive_message_length", self.gw.cfg.limits.max_request_bytes),
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers((self.handlers(), *extra))
        if tls is None:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        else:
            key, cert = Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes()
            credentials = grpc.ssl_server_credentials([(key, cert)])
            bound = self.server.add_secure_port(f"{host}:{port}", credentials)
        if bound == 0:
            raise refused("grpc_port", host, port)
        await self.server.start()
        return bound

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
        return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}

    def _deadline(
        self,
        context: grpc.aio.ServicerContext,
        md: dict[str, str],
        timeout_us: int | None = None,
        model: str = "",
    ) -> float:
        return self.gw.deadline(md.get(self.timeout_key), timeout_us, model, context.time_remaining())

    @staticmethod
    async def _decode(cls: type[M], request: bytes) -> M:
        """The request message, or BadRequest naming the message type; large ones off the loop."""
        try:
            if len(request) > OFF_LOOP_BYTES:
                return await asyncio.to_thread(cls.FromString, request)
            return cls.FromString(request)
        except DecodeError as exc:
            raise BadRequest(f"malformed {cls.DESCRIPTOR.name}: {exc}") from None

    async def _parse(self, cls: type[M], request: bytes, context: grpc.aio.ServicerContext) -> M:
        """The request message, or INVALID_ARGUMENT naming the message type (never UNKNOWN/INTERNAL)."""
        try:
            return await self._decode(cls, request)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            raise AssertionError("unreachable") from None

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException, request_id: str) -> None:
        if isinstance(exc, GatewayError):
            message = exc.message
            if exc.headers:
                context.set_trailing_metadata(
                    tuple((k, v) for k, v in exc.headers.items()) + (("x-request-id", request_id),)
                )
        else:
            logger.exception("unhandled error in gRPC front, request_id=%s", request_id)
            message = f"internal gateway error; see the gateway log for request id {request_id}"
        await context.abort(grpc_code_for(exc), message)

    async def _proxy(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext, model: str, version: str
    ) -> bytes:
        md = self._metadata(context)
        request_id = ""
        self.gw.inflight += 1
        try:
            request_id = checked_request_id(md.get("x-request-id"))
            await self._admit(model, md, context)
            deadline = self._deadline(context, md)

            async def attempt(server: UpstreamServer, timeout_s: float) -> bytes:
                return await server.grpc_call(method, request, timeout_s, (("x-request-id", request_id),))

            outcome = await self.gw.send_metadata(model, version, md.get(self.region_key), deadline, attempt)
            return outcome.value
        except GatewayError as exc:
            await self._abort(context, exc, request_id)
            raise AssertionError("unreachable") from None
        finally:
            self.gw.inflight -= 1

    async def _admit(self, model: str, md: dict[str, str], context: grpc.aio.ServicerContext) -> Any:
        """Admission shared by every method: drain, in-flight bound, auth, model list, rate limits.
        A call through the bridge had its key and rate limit checked from its headers already."""
        pre: Precheck | None = getattr(context, "precheck", None)
        if pre is None or pre.rate is None:
            client = client_address(context.peer())
            return await self.gw.admit(model, md.get("authorization"), md.get("x-api-key"), client)
        self.gw.check_slot()
        await pre.rate
        self.gw.admit_model(pre.principal, model)
        return pre.principal

    def precheck(self, path: bytes, headers: list[tuple[str, str]]) -> Precheck:
        """The bridge's gate (gateway/grpc_bridge.py), run on a call's headers before its message
        is held: the key now, the rate limit as a task; GatewayError refuses the call unread."""
        client = ""
        authorization = api_key = None
        for name, value in headers:
            if name == PEER_HEADER:
                client = value
            elif name == "authorization":
                authorization = value
            elif name == "x-api-key":
                api_key = value
        if path.rpartition(b"/")[2].decode("latin-1") in UNKEYED_METHODS:
            return Precheck(self.gw.caller_of(None, client))
        principal = self.gw.auth.authenticate(authorization, api_key)
        rate = asyncio.ensure_future(self.gw.check_rate(principal, client))
        return Precheck(self.gw.caller_of(principal, client), principal, rate)

    # -- methods -----------------------------------------------------------------------------------
    async def server_live(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return pb.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return pb.ServerReadyResponse(ready=self.gw.ready()).SerializeToString()

    async def model_ready(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = await self._parse(pb.ModelReadyRequest, request, context)
        return await self._proxy("ModelReady", request, context, req.name, req.version)

    async def server_metadata(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._proxy("ServerMetadata", request, context, "", "")

    async def model_metadata(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = await self._parse(pb.ModelMetadataRequest, request, context)
        return await self._proxy("ModelMetadata", request, context, req.name, req.version)

    async def model_config(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = await self._parse(pb.ModelConfigRequest, request, context)
        return await self._proxy("ModelConfig", request, context, req.name, req.version)

    async def model_statistics(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Triton's ModelStatistics, summed across the servers the model is routed to."""
        md = self._metadata(context)
        request_id = ""
        req = await self._parse(pb.ModelStatisticsRequest, request, context)
        self.gw.inflight += 1
        try:
            request_id = checked_request_id(md.get("x-request-id"))
            principal = await self._admit(req.name, md, context)
            deadline = self._deadline(context, md)
            gw = self.gw
            servers = statistics_servers(
                gw.servers,
                {name: region.servers for name, region in gw.router.regions.items()},
                req.name,
                req.version,
                md.get(self.region_key),
                self.region_key,
                gw.clock(),
                md.get(SERVER_HEADER),
            )
            passed_on = tuple((k, v) for k, v in md.items() if gw.forwarded(k))
            metadata = (("x-request-id", request_id), *passed_on)

            async def fetch(server: UpstreamServer) -> dict[str, Any]:
                raw = await server.grpc_call(
                    "ModelStatistics", request, max(0.0, deadline - gw.clock()), metadata
                )
                return json_format.MessageToDict(
                    pb.ModelStatisticsResponse.FromString(raw), preserving_proto_field_name=True
                )

            answers, answered = await gather_statistics(servers, fetch)
            merged = only_allowed(merge_statistics(answers), principal)
            context.set_trailing_metadata(
                (
                    ("x-request-id", request_id),
                    ("x-skewserve-stats-servers", ",".join(s.name for s in answered)),
                )
            )
            return json_format.ParseDict(merged, pb.ModelStatisticsResponse()).SerializeToString()
        except GatewayError as exc:
            await self._abort(context, exc, request_id)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await self._abort(context, exc, request_id)
        finally:
            self.gw.inflight -= 1
        raise AssertionError("unreachable")

    async def model_infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        gw = self.gw
        started = gw.clock()
        md = self._metadata(context)
        sent_id = md.get("x-request-id")
        request_id = ""
        status = "OK"
        region = server_name = ""
        model = ""
        gw.inflight += 1
        held = 0
        caller = ""
        plan: Plan | None = None
        role: Role | None = None
        try:
            request_id = checked_request_id(sent_id) if sent_id else ""
            # An unknown key is refused before a byte of the message is parsed; the message's bytes
            # count against its caller while it is handled.
            pre: Precheck | None = getattr(context, "precheck", None)
            if pre is not None and pre.rate is not None:  # the bridge checked the key from the headers
                principal, caller = pre.principal, pre.caller
            else:
                principal = gw.auth.authenticate(md.get("authorization"), md.get("x-api-key"))
                caller = gw.caller_of(principal, client_address(context.peer()))
            gw.bodies.reserve(caller, len(request))
            held = len(request)
            req = await self._decode(pb.ModelInferRequest, request)
            model, version = req.model_name, req.model_version
            # The protobuf `id` is Triton's to echo whatever it holds; it names the request in logs
            # and upstream metadata only when it is a valid metadata value.
            request_id = request_id or (req.id if is_valid_request_id(req.id) else new_request_id())
            await self._admit(model, md, context)
            _check_tensor_counts(req, self.max_tensors)
            _check_echoed_lengths(req)
            if self.max_batch:
                for inp in req.inputs:
                    if inp.shape and inp.shape[0] > self.max_batch:
                        raise BadRequest(
                            f"input {inp.name!r} has batch size {inp.shape[0]}, above the gateway limit of {self.max_batch}"
                        )
            timeout_us = _timeout_us(req)
            sequence_id = _sequence_id(req)
            deadline = self._deadline(context, md, timeout_us, model)
            passed_on = tuple((k, v) for k, v in md.items() if gw.forwarded(k))
            metadata = (("x-request-id", request_id), *passed_on)
            if gw.traffic is not None:  # a model in canary: its unversioned requests get a version
                version, plan, role = gw.traffic.choose(model, version, md.get(self.sticky_key) or caller)
                if plan is not None:
                    request = request + version_field(version)

            def attempt_with(message: bytes) -> Attempt[bytes]:
                async def attempt(server: UpstreamServer, timeout_s: float) -> bytes:
                    return await server.grpc_call("ModelInfer", message, timeout_s, metadata)

                return attempt

            attempt = attempt_with(request)

            trailing = [("x-request-id", request_id)]
            # A sequence's answers depend on its state, forwarded metadata's on what it says.
            if gw.cache_enabled(model) and sequence_id is None and not passed_on:
                raw, route, state = await self._cached(
                    request,
                    req,
                    model,
                    version,
                    md.get(self.region_key),
                    deadline,
                    attempt,
                    gw.cache_tenant(principal),
                )
                trailing.append(("x-skewserve-cache", "hit" if state == "hit" else "miss"))
            else:
                outcome = await gw.send(
                    model, version, md.get(self.region_key), deadline, attempt, sequence_id=sequence_id
                )
                raw, route = outcome.value, outcome.route
            if route is not None:
                region, server_name = route.region, route.server.name
                trailing += [("x-skewserve-region", region), ("x-skewserve-server", server_name)]
            context.set_trailing_metadata(tuple(trailing))
            if role == "stable" and plan is not None and plan.shadow > 0 and sequence_id is None:
                mirror = attempt_with(request + version_field(plan.canary))
                offer_grpc(gw, plan, model, raw, mirror, len(request))
            return raw
        except GatewayError as exc:
            status = exc.grpc_code.name
            await self._abort(context, exc, request_id)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            status = "INTERNAL"
            await self._abort(context, exc, request_id)
        finally:
            gw.inflight -= 1
            gw.bodies.release(caller, held)
            if plan is not None and role is not None:
                Traffic.record(plan, role, gw.clock() - started, status not in _SERVER_FAULTS)
            gw.metrics.request(model, region, server_name, "grpc", status, gw.clock() - started)
        raise AssertionError("unreachable")

    async def _cached(
        self,
        raw_request: bytes,
        req: pb.ModelInferRequest,
        model: str,
        version: str,
        pinned: str | None,
        deadline: float,
        attempt: Any,
        tenant: str = "",
    ) -> tuple[bytes, Any, str]:
        gw = self.gw
        if pinned is not None:
            gw.router.check_pin(pinned)  # before the exact-bytes alias lookup below
        request_id = req.id
        resolved = version or gw.router.latest_version(model)
        alias = None
        if not request_id and len(raw_request) < OFF_LOOP_BYTES:
            context = b"%s\0%s\0%d/%d\0%s" % (
                model.encode(),
                resolved.encode(),
                self.max_batch,
                self.max_tensors,
                tenant.encode(),
            )
            alias = self.aliases.digest(context, raw_request)
            key = self.aliases.key(alias)
            stored = await gw.cache_lookup(key, model) if key is not None else None
            if stored is not None:
                return self.aliases.answer(alias, stored, lambda b: _restamp(b, "")), None, "hit"
        req.id = ""
        req.model_version = ""
        if req.ByteSize() > OFF_LOOP_BYTES:
            material = await asyncio.to_thread(req.SerializeToString, deterministic=True)
        else:
            material = req.SerializeToString(deterministic=True)
        key = await cache_key_async("grpc", model, resolved, material, tenant=tenant)
        if alias is not None:
            self.aliases.remember(alias, key)
        route_box: list[Any] = []

        async def fetch() -> tuple[bytes, bytes | None]:
            outcome = await gw.send(model, version, pinned, deadline, attempt)
            route_box.append(outcome.route)
            raw = outcome.value
            answered = pb.ModelInferResponse.FromString(raw).model_version
            return raw, (raw if resolved and answered == resolved else None)

        raw, state = await gw.cached(key, model, fetch, lambda b: b, deadline, pinned)
        if state != "miss":
            raw = _restamp(raw, request_id)
        return raw, (route_box[0] if route_box else None), state
