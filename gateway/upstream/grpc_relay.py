"""Raw-bytes gRPC calls to Triton's `inference.GRPCInferenceService`.

The gateway's gRPC front hands ModelInfer requests on as the bytes the client sent and returns
Triton's bytes as they came: no protobuf decode/re-encode of tensors on the hot path. Two carriers
with one interface: `GrpcChannel` (a grpc.aio channel per server) and `RelayChannel` (through the
HAProxy data plane, which holds the HTTP/2 connections; listen.grpc_data_plane: haproxy).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

from gateway.errors import UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from gateway.upstream.haproxy import TARGET_IP_HEADER, TARGET_PORT_HEADER
from gateway.upstream.http_client import HttpPool, HttpResponse
from gateway.upstream.tls import UpstreamTls

SERVICE = "/inference.GRPCInferenceService/"
# Codes meaning Triton never produced a response: another server may be tried.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
_MAX_MESSAGE = 256 * 1024 * 1024


def triton_channel(address: str, tls: UpstreamTls | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to one Triton, or over `tls` to another gateway (created in the running
    loop, which it binds to)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.enable_retries", 0),  # retries are the gateway's decision, not the channel's
        ("grpc.keepalive_time_ms", 10_000),
    ]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials, options=options)


class GrpcChannel:
    """One channel (HTTP/2 connection) to a Triton gRPC endpoint, with raw unary methods."""

    def __init__(self, address: str, tls: UpstreamTls | None = None) -> None:
        self.address = address
        self.tls = tls
        # Created on first use: a grpc.aio channel binds to the running event loop.
        self.channel: grpc.aio.Channel | None = None
        self._methods: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}

    def _method(self, name: str) -> grpc.aio.UnaryUnaryMultiCallable:
        m = self._methods.get(name)
        if m is None:
            if self.channel is None:
                self.channel = triton_channel(self.address, self.tls)
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


class StreamChannel:
    """A grpc.aio channel for one Triton's streams (ModelStreamInfer): bidirectional calls, which the
    unary relay through HAProxy cannot carry. Created on first use (it binds to the running loop)."""

    def __init__(self, address: str, tls: UpstreamTls | None = None) -> None:
        self.address = address
        self.tls = tls
        self.channel: grpc.aio.Channel | None = None

    def open(self, metadata: Sequence[tuple[str, str]], timeout_s: float | None) -> grpc.aio.StreamStreamCall:
        if self.channel is None:
            self.channel = triton_channel(self.address, self.tls)
        method = self.channel.stream_stream(
            SERVICE + "ModelStreamInfer", request_serializer=None, response_deserializer=None
        )
        return method(metadata=tuple(metadata) or None, timeout=timeout_s)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


def upstream_error(address: str, code: grpc.StatusCode, details: str) -> Exception:
    """Triton's gRPC error answer as the gateway's error: a timeout, a server that produced no
    answer (another may be tried), or Triton's refusal in its own code and words."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout(f"{address}: {details or 'deadline exceeded'}")
    if code in _RETRYABLE:
        return UpstreamUnavailable(f"{address}: {code.name}: {details}")
    return UpstreamRejected(details or code.name, grpc_code=code, http_status=_http_for(code))


def _http_for(code: grpc.StatusCode) -> int:
    return {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.UNIMPLEMENTED: 501,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.PERMISSION_DENIED: 403,
    }.get(code, 500)


class GrpcRelay:
    """Upstream gRPC calls through the data plane's HAProxy (gateway/upstream/haproxy.py), which holds the
    HTTP/2 connections to every Triton: this worker speaks HTTP/1.1 to it over a unix socket,
    naming the server to reach per call. One per worker, shared by every server's `RelayChannel`."""

    def __init__(self, relay_socket: str, connect_timeout_s: float = 1.0) -> None:
        self.pool = HttpPool("haproxy:0", connect_timeout_s, max_idle=512, unix_path=relay_socket)

    def channel(self, address: str) -> RelayChannel:
        return RelayChannel(self, address)

    async def close(self) -> None:
        await self.pool.close()


class RelayChannel:
    """`GrpcChannel`'s interface for one Triton gRPC address, carried by the shared `GrpcRelay`."""

    # Resolved addresses are kept this long: HAProxy needs an IP, configs may name hosts.
    RESOLVE_TTL_S = 30.0

    def __init__(self, relay: GrpcRelay, address: str) -> None:
        self.relay = relay
        self.address = address
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), port
        self._target: tuple[bytes, bytes] | None = None
        self._resolved_at = 0.0
        try:  # an address (what discovery produces) never needs resolving
            ipaddress.ip_address(self.host)
            self._literal: tuple[bytes, bytes] | None = (self.host.encode(), port.encode())
        except ValueError:
            self._literal = None

    async def _resolve(self) -> tuple[bytes, bytes]:
        if self._literal is not None:
            return self._literal
        loop = asyncio.get_running_loop()
        if self._target is not None and loop.time() - self._resolved_at < self.RESOLVE_TTL_S:
            return self._target
        try:
            infos = await loop.getaddrinfo(self.host, int(self.port), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise UpstreamUnavailable(f"{self.address}: cannot resolve {self.host!r} ({exc})") from exc
        ip = str(infos[0][4][0])
        self._target = (ip.encode(), self.port.encode())
        self._resolved_at = loop.time()
        return self._target

    async def call(
        self, method: str, request: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]] = ()
    ) -> bytes:
        ip, port = await self._resolve()
        headers = [
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            # No grpc-timeout: when the gateway's bound passes it closes this connection, and HAProxy
            # resets the stream, which cancels the call in Triton. A deadline expiring in Triton
            # instead ends in RST_STREAM, which HAProxy reports as 502: a server fault it is not.
            (TARGET_IP_HEADER.encode(), ip),
            (TARGET_PORT_HEADER.encode(), port),
        ]
        headers += [(k.encode("ascii"), v.encode("ascii")) for k, v in metadata]
        body = b"\x00" + len(request).to_bytes(4, "big") + request
        try:
            resp = await self.relay.pool.request(
                b"POST", SERVICE.encode() + method.encode(), body, headers, timeout_s
            )
        except UpstreamTimeout:
            raise UpstreamTimeout(f"{self.address}: no response within {timeout_s:.3f}s") from None
        except UpstreamUnavailable as exc:
            raise UpstreamUnavailable(f"{self.address}: {exc}") from None
        return self._result(resp)

    def _result(self, resp: HttpResponse) -> bytes:
        status = resp.header(b"grpc-status")
        if status is None:
            # HAProxy's own answer: 503 = Triton refused or reset the connection, 504 = timed out.
            if resp.status == 504:
                raise UpstreamTimeout(f"{self.address}: HAProxy timed out waiting for Triton")
            raise UpstreamUnavailable(
                f"{self.address}: no gRPC response (HTTP {resp.status} from the data plane)"
            )
        try:
            code = _CODES[int(status)]
        except (ValueError, KeyError):
            code = grpc.StatusCode.UNKNOWN
        if code is grpc.StatusCode.OK:
            body = resp.body
            if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5 or body[0] != 0:
                raise UpstreamUnavailable(f"{self.address}: malformed gRPC response body ({len(body)} bytes)")
            return body[5:]
        details = urllib.parse.unquote((resp.header(b"grpc-message") or b"").decode("latin-1"))
        raise upstream_error(self.address, code, details)

    async def close(self) -> None:
        pass  # connections belong to the shared relay


_CODES = {c.value[0]: c for c in grpc.StatusCode}
