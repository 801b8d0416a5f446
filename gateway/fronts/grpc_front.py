"""`inference.GRPCInferenceService` front: the gateway's gRPC methods, carried either by the HAProxy
data plane (gateway/fronts/grpc_bridge.py, the default) or by grpc.aio in the gateway's event loop.

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
from typing import Any, Final, TypeVar

import grpc
import grpc.aio
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2 as pb

from gateway.config import TlsConfig
from gateway.core import Gateway
from gateway.errors import BadRequest, GatewayError, grpc_code_for
from gateway.forward_headers import forwarded_metadata
from gateway.fronts.grpc_bridge import Precheck
from gateway.fronts.grpc_infer import OFF_LOOP_BYTES, GrpcLimits, GrpcWire, grpc_call
from gateway.fronts.listen import check_free, refused
from gateway.fronts.request_id import checked_request_id
from gateway.pipeline import metadata as pipeline_metadata
from gateway.pipeline import run, statistics
from gateway.pipeline.call import Call
from gateway.pipeline.statistics import SERVER_HEADER
from gateway.upstream.haproxy import PEER_HEADER
from gateway.upstream.server import UpstreamServer

logger: Final = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
SERVICE: Final = "inference.GRPCInferenceService"
_FORWARD_METADATA: Final = ("x-request-id",)

# Methods that answer without a key, as Triton's health endpoints do.
UNKEYED_METHODS: Final = frozenset({"ServerLive", "ServerReady"})
# What GrpcFront.methods() serves, for the data plane's refusal of every other path from its headers.
UNARY_METHODS: Final = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "ModelInfer",
)


class GrpcFront:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        cfg = gateway.cfg
        self.limits = GrpcLimits(cfg)
        self._passed: asyncio.Future[None] | None = None  # a rate check with nothing to check
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
        call = Call("grpc", 0.0)
        try:
            call = self._call(context, model, version)
            metadata = (("x-request-id", call.request_id),)

            async def attempt(server: UpstreamServer, timeout_s: float) -> bytes:
                return await server.grpc_call(method, request, timeout_s, metadata)

            return (await pipeline_metadata.ask(self.gw, call, attempt)).value
        except GatewayError as exc:
            await self._abort(context, exc, call.request_id)
            raise AssertionError("unreachable") from None

    def _call(self, context: grpc.aio.ServicerContext, model: str, version: str) -> Call:
        """A metadata or statistics call as admission reads it (BadRequest for a bad request id)."""
        md = self._metadata(context)
        call = grpc_call(self.gw, self.limits, context, md, self.gw.clock(), model, version)
        call.request_id = checked_request_id(md.get("x-request-id"))
        return call

    def precheck(self, path: bytes, headers: list[tuple[str, str]]) -> Precheck:
        """The bridge's gate (gateway/fronts/grpc_bridge.py), run on a call's headers before its message
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
        rate: asyncio.Future[None]
        if self.gw.rate_limited(principal):
            rate = asyncio.ensure_future(self.gw.check_rate(principal, client))
        else:  # nothing to wait for: no task per call
            rate = self._no_limit()
        return Precheck(self.gw.caller_of(principal, client), principal, rate)

    def _no_limit(self) -> asyncio.Future[None]:
        done = self._passed
        if done is None:
            done = self._passed = asyncio.get_running_loop().create_future()
            done.set_result(None)
        return done

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
        req = await self._parse(pb.ModelStatisticsRequest, request, context)
        call = Call("grpc", 0.0)
        try:
            call = self._call(context, req.name, req.version)
            md = self._metadata(context)
            metadata = (("x-request-id", call.request_id), *forwarded_metadata(md, self.gw.forwarded))

            async def fetch(server: UpstreamServer, timeout_s: float) -> dict[str, Any]:
                raw = await server.grpc_call("ModelStatistics", request, timeout_s, metadata)
                return json_format.MessageToDict(
                    pb.ModelStatisticsResponse.FromString(raw), preserving_proto_field_name=True
                )

            merged, answered = await statistics.answer(self.gw, call, md.get(SERVER_HEADER), fetch)
            context.set_trailing_metadata(
                (
                    ("x-request-id", call.request_id),
                    ("x-skewserve-stats-servers", ",".join(s.name for s in answered)),
                )
            )
            return json_format.ParseDict(merged, pb.ModelStatisticsResponse()).SerializeToString()
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._abort(context, exc, call.request_id)
        raise AssertionError("unreachable")

    async def model_infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """One ModelInfer call through the pipeline (gateway/pipeline/run.py)."""
        gw = self.gw
        wire = GrpcWire(gw, self.limits, context, request)
        call = wire.call(self._metadata(context), gw.clock())
        await run.infer(gw, call, wire)
        return wire.answer
