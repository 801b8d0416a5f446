"""Raw-bytes gRPC calls to Triton's `inference.GRPCInferenceService`.

The gateway's gRPC front hands ModelInfer requests on as the bytes the client sent and returns
Triton's bytes as they came: no protobuf decode/re-encode of tensors on the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import grpc.aio

from gateway.errors import UpstreamRejected, UpstreamTimeout, UpstreamUnavailable

SERVICE = "/inference.GRPCInferenceService/"
# Codes meaning Triton never produced a response: another server may be tried.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
_MAX_MESSAGE = 256 * 1024 * 1024


class GrpcChannel:
    """One channel (HTTP/2 connection) to a Triton gRPC endpoint, with raw unary methods."""

    def __init__(self, address: str) -> None:
        self.address = address
        # Created on first use: a grpc.aio channel binds to the running event loop.
        self.channel: grpc.aio.Channel | None = None
        self._methods: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}

    def _method(self, name: str) -> grpc.aio.UnaryUnaryMultiCallable:
        m = self._methods.get(name)
        if m is None:
            if self.channel is None:
                self.channel = grpc.aio.insecure_channel(
                    self.address,
                    options=[
                        ("grpc.max_send_message_length", _MAX_MESSAGE),
                        ("grpc.max_receive_message_length", _MAX_MESSAGE),
                        ("grpc.enable_retries", 0),  # retries are the gateway's decision, not the channel's
                        ("grpc.keepalive_time_ms", 10_000),
                    ],
                )
            m = self.channel.unary_unary(SERVICE + name, request_serializer=None, response_deserializer=None)
            self._methods[name] = m
        return m

    async def call(
        self, method: str, request: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]] = ()
    ) -> bytes:
        try:
            return await self._method(method)(request, timeout=timeout_s, metadata=metadata or None)  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise UpstreamTimeout(f"{self.address}: no response within {timeout_s:.3f}s") from exc
            if code in _RETRYABLE:
                raise UpstreamUnavailable(f"{self.address}: {code.name}: {exc.details()}") from exc
            raise UpstreamRejected(
                exc.details() or code.name, grpc_code=code, http_status=_http_for(code)
            ) from exc

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


def _http_for(code: grpc.StatusCode) -> int:
    return {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.UNIMPLEMENTED: 501,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.PERMISSION_DENIED: 403,
    }.get(code, 500)
