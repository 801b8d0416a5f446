"""gRPC `ModelStreamInfer` through the gateway: one client stream carried to one Triton's stream.

Sequence streams and decoupled models (any number of responses per request) need every message
of a stream on one server, so the balancer picks a server once, from the first message's model
(a sequence's correlation id picks the same server its unary requests go to), and the stream stays
there. Messages go on as the client sent them and responses come back as Triton sent them, each
as it arrives: no cache, no hedging, and no retry once anything was sent. Cancellation goes both
ways: a client that cancels cancels the upstream stream; a server that fails (or is killed) ends
the client's stream with its status (UNAVAILABLE), never a hang.

Under the hostile-client rules: the key is checked when the stream opens, open streams are bounded
per worker and per caller (gateway/state/stream_slots.py), every message is checked against the key's
model list and rate limit (a refused message gets an in-stream error, as Triton reports a failed
request, and the stream goes on), a stream idle both ways past limits.stream_idle_timeout_s ends,
and HTTP/2 flow control holds a client that sends faster than Triton answers.

Served by grpc.aio: in the grpcio plane on the public port, in the HAProxy plane on each worker's
stream socket, to which HAProxy sends this one method as HTTP/2 (gateway/upstream/haproxy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from gateway.core import Gateway
from gateway.errors import (
    BadRequest,
    GatewayError,
    NoReadyServer,
    RequestTooLarge,
    Unauthenticated,
    UpstreamRejected,
    UpstreamTimeout,
    grpc_code_for,
)
from gateway.fleet.dispatch import check_version
from gateway.fleet.router import Route
from gateway.forward_headers import forwarded_metadata
from gateway.fronts.grpc_front import SERVICE
from gateway.fronts.grpc_infer import (
    OFF_LOOP_BYTES,
    _check_echoed_lengths,
    _check_tensor_counts,
    _sequence_id,
)
from gateway.fronts.request_id import checked_request_id
from gateway.pipeline import admission, record
from gateway.pipeline.call import Call
from gateway.pipeline.shadow_send import version_field
from gateway.state.limits import client_address
from gateway.upstream.haproxy import PEER_HEADER
from gateway.upstream.server import UpstreamServer

logger = logging.getLogger(__name__)
METHOD = "ModelStreamInfer"
PATH = f"/{SERVICE}/{METHOD}"
_PENDING = 8  # responses queued for a slow client before Triton's stream is read no further
_END = object()
# A stream ending with these says the server failed, not the client's input.
_SERVER_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class OpenStream:
    """One client stream as it goes: its `Call` (what admission took: key, caller, bytes, the stream
    slot; where it went; how it ended), the client's side, and the last time anything moved."""

    __slots__ = ("call", "requests", "context", "metadata", "idle_at")

    def __init__(
        self,
        call: Call,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
        metadata: dict[str, str],
    ) -> None:
        self.call = call
        self.requests = requests
        self.context = context
        self.metadata = metadata
        self.idle_at = call.started  # the last time anything moved, either way


class StreamInfer:
    """The `ModelStreamInfer` behaviour for grpc.aio (raw bytes in, raw bytes out)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        cfg = gateway.cfg
        self.idle_s = cfg.limits.stream_idle_timeout_s
        self.max_tensors = cfg.limits.max_tensors
        self.region_key = cfg.routing.region_header.lower()

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(
            self.serve, request_deserializer=None, response_serializer=None
        )
        return grpc.method_handlers_generic_handler(SERVICE, {METHOD: method})

    async def serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """The handler: responses are written here (`context.write`), in this task, so that a
        client that stops reading is ended, and everything released, in this task's own code.
        Admission as every request's (gateway/pipeline/admission.py): the key and the rate limit
        when the stream opens, then a stream slot; `record.finish` gives everything back."""
        gw = self.gw
        stream = self._open(requests, context)
        call = stream.call
        try:
            call.request_id = checked_request_id(stream.metadata.get("x-request-id"))
            await admission.enter(gw, call, "stream")
            first = await self._next(stream)
            if first is _END:
                return  # closed before sending anything: nothing to answer
            assert isinstance(first, bytes)
            self._check_size(first)
            admission.hold(gw, call, len(first))
            req = self._check(call, await _parse(first))
            first = self._pinned(req, first)
            call.model = req.model_name
            server = self._server(req, call.pinned)
            call.route = Route(server, server.region, False)
            async with contextlib.aclosing(self._relay(stream, server, first)) as responses:
                async for response in responses:
                    await self._deliver(stream, response)
        except GatewayError as exc:
            call.status = exc.grpc_code.name
            await context.abort(grpc_code_for(exc), exc.message)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            call.status = "CANCELLED"
            raise
        except BaseException:
            call.status = "INTERNAL"
            raise
        finally:
            record.finish(gw, call)

    def _open(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> OpenStream:
        """The stream's call: named (no model yet) so that the key and the rate limit are checked
        as it opens; each message's model is checked as it comes."""
        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        call = Call("grpc_stream", self.gw.clock(), named=True, status="OK")
        call.client = _client(context, md)
        call.authorization, call.api_key = md.get("authorization"), md.get("x-api-key")
        call.pinned = md.get(self.region_key)
        return OpenStream(call, requests, context, md)

    async def _deliver(self, stream: OpenStream, response: bytes) -> None:
        """One response to the client; a client that reads nothing for the idle bound ends its stream."""
        try:
            await asyncio.wait_for(stream.context.write(response), self.idle_s)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(
                f"the client read no response for {self.idle_s:g}s (limits.stream_idle_timeout_s)"
            ) from None
        stream.idle_at = self.gw.clock()

    # -- one message ----------------------------------------------------------------------------
    def _check_size(self, raw: bytes) -> None:
        """The data plane's stream server refuses larger messages before holding them; the grpcio
        plane serves streams beside unary calls (max_request_bytes), so it is checked here too."""
        bound = self.gw.cfg.limits.stream_message_bytes
        if len(raw) > bound:
            raise RequestTooLarge(
                f"stream message of {len(raw)} bytes exceeds the limit of {bound} "
                "(limits.max_stream_message_bytes: a caller's open streams times this fit its byte bound)"
            )

    def _check(self, call: Call, req: pb.ModelInferRequest) -> pb.ModelInferRequest:
        """The message, checked as a unary ModelInfer is; GatewayError naming what is wrong."""
        admission.check_model(self.gw, call, req.model_name)
        _check_tensor_counts(req, self.max_tensors)
        _check_echoed_lengths(req)
        return req

    def _pinned(self, req: pb.ModelInferRequest, raw: bytes) -> bytes:
        """A message for a model in canary, unversioned: pinned to the stable version (else Triton
        answers from the newest version a server holds, the canary where it passed its check)."""
        traffic = self.gw.traffic
        if traffic is None or req.model_version:
            return raw
        version = traffic.stable_pin(req.model_name, "")
        if not version:
            return raw
        req.model_version = version
        return raw + version_field(version)

    def _server(self, req: pb.ModelInferRequest, pinned: str | None) -> UpstreamServer:
        """The stream's one server: the balancer's pick for the first message's model (a sequence's
        own server for a correlation id); any server for an unknown model, so Triton answers it."""
        router = self.gw.router
        sequence = _sequence_id(req)
        try:
            version = check_version(req.model_version)
            return router.route(
                req.model_name, version, pinned, sticky=None if sequence is None else str(sequence)
            ).server
        except NoReadyServer:
            if pinned is None and not router.knows_model(req.model_name):
                return router.any_server()
            raise

    async def _next(self, stream: OpenStream) -> bytes | object:
        try:
            message = await asyncio.wait_for(anext(stream.requests), self.idle_s)
        except StopAsyncIteration:
            return _END
        except asyncio.TimeoutError:
            raise UpstreamTimeout(self._idle_message()) from None
        stream.idle_at = self.gw.clock()
        return message

    def _idle_message(self) -> str:
        return f"no stream message either way for {self.idle_s:g}s (limits.stream_idle_timeout_s)"

    # -- the stream -----------------------------------------------------------------------------
    async def _relay(
        self, stream: OpenStream, server: UpstreamServer, first: bytes
    ) -> AsyncGenerator[bytes, None]:
        gw, call = self.gw, stream.call
        loop = asyncio.get_running_loop()
        passed_on = forwarded_metadata(stream.metadata, gw.forwarded)
        bound = call.principal.headers if call.principal is not None else ()
        upstream = server.streams.open(
            (("x-request-id", call.request_id), *passed_on, *bound), stream.context.time_remaining()
        )
        out: asyncio.Queue[bytes | object] = asyncio.Queue(_PENDING)
        server.open_streams += 1
        server.requests += 1
        tasks = [
            loop.create_task(self._send(stream, upstream, first, out)),
            loop.create_task(self._receive(stream, upstream, out)),
        ]
        try:
            # Where the stream went, before its first response (a unary call says so in trailers).
            await stream.context.send_initial_metadata(
                (("x-skewserve-region", server.region), ("x-skewserve-server", server.name))
            )
            while True:
                item = await self._taken(stream, out)
                if item is _END:
                    break
                if isinstance(item, _Failed):
                    raise item.error
                assert isinstance(item, bytes)
                yield item
            code = await upstream.code()
            if code != grpc.StatusCode.OK:
                details = await upstream.details() or code.name
                if code in _SERVER_FAULTS:
                    gw.detector.failure(server, f"stream ended: {code.name}: {details}", gw.clock())
                    details = f"server {server.name}: {details}"
                raise UpstreamRejected(details, grpc_code=code)
            gw.detector.success(server)
        finally:
            server.open_streams -= 1
            upstream.cancel()  # a no-op once it ended; otherwise the client went away or failed
            for task in tasks:
                task.cancel()
            # Waited for without raising their errors, and without swallowing this task's own cancel.
            await asyncio.wait(tasks)

    async def _taken(self, stream: OpenStream, out: asyncio.Queue[bytes | object]) -> object:
        """The next response, or the end; DEADLINE_EXCEEDED when nothing moved for the idle bound
        (a message the client sent moves the bound on while this waits)."""
        while True:
            left = stream.idle_at + self.idle_s - self.gw.clock()
            if left <= 0:
                raise UpstreamTimeout(self._idle_message())
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(out.get(), left)

    async def _send(
        self,
        stream: OpenStream,
        upstream: grpc.aio.StreamStreamCall,
        first: bytes,
        out: asyncio.Queue[bytes | object],
    ) -> None:
        """The client's messages on to Triton as they come. Each counts against its caller from
        its arrival until written; then the rate, then the message (parsed off the loop when
        large) are checked; a refused one is answered here, in the stream, and the stream goes on."""
        gw, call = self.gw, stream.call
        try:
            await upstream.write(first)
            admission.give_back(gw, call, len(first))
            async for raw in stream.requests:
                stream.idle_at = gw.clock()
                try:
                    admission.recheck(gw, call)
                except Unauthenticated as revoked:
                    # Its next message is not forwarded, and the stream ends.
                    await out.put(_Failed(revoked))  # queued before the cancel's end of Triton's side
                    upstream.cancel()
                    return
                await self._forward(call, upstream, raw, out)
            await upstream.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # Triton ended the stream: its status is reported from the call
        except Exception as exc:  # never a silent stall: the stream ends, named, and the log says why
            logger.exception("stream: forwarding the client's messages failed")
            upstream.cancel()
            await out.put(
                _Failed(GatewayError(f"the gateway failed forwarding this stream: {type(exc).__name__}"))
            )

    async def _forward(
        self, call: Call, upstream: grpc.aio.StreamStreamCall, raw: bytes, out: asyncio.Queue[bytes | object]
    ) -> None:
        """One message after the first: held, its rate and contents checked, written on; a refused
        one answered in the stream."""
        gw = self.gw
        req: pb.ModelInferRequest | None = None
        try:
            self._check_size(raw)
            admission.hold(gw, call, len(raw))
        except GatewayError as exc:
            await out.put(_error_response(None, exc.message))
            return
        try:
            await admission.check_rate(gw, call)
            req = await _parse(raw)
            self._check(call, req)
            await upstream.write(self._pinned(req, raw))
        except GatewayError as exc:
            await out.put(_error_response(req, exc.message))
        finally:
            admission.give_back(gw, call, len(raw))

    async def _receive(
        self, stream: OpenStream, upstream: grpc.aio.StreamStreamCall, out: asyncio.Queue[bytes | object]
    ) -> None:
        """Triton's responses as they come; the end (whatever the status) once its stream ends."""
        try:
            while True:
                message = await upstream.read()
                if message is grpc.aio.EOF:
                    break
                stream.idle_at = self.gw.clock()
                await out.put(message)
        except grpc.aio.AioRpcError:
            pass  # the status is read from the call
        await out.put(_END)


class _Failed:
    """Put in a stream's queue when forwarding failed: the relay raises `error`."""

    __slots__ = ("error",)

    def __init__(self, error: GatewayError) -> None:
        self.error = error


async def _parse(raw: bytes) -> pb.ModelInferRequest:
    """A stream message, parsed off the loop when large (as unary ModelInfer is); BadRequest if malformed."""
    try:
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(pb.ModelInferRequest.FromString, raw)
        return pb.ModelInferRequest.FromString(raw)
    except DecodeError as exc:
        raise BadRequest(f"malformed ModelInferRequest: {exc}") from None


def _client(context: grpc.aio.ServicerContext, md: dict[str, str]) -> str:
    """The client's address: from HAProxy's header when the call came through it (a unix socket
    peer, which only HAProxy reaches), else the connection's own; a client's header never counts."""
    peer = context.peer() or ""
    if peer.startswith("unix:"):
        return md.get(PEER_HEADER, "")
    return client_address(peer)


def _error_response(sent: pb.ModelInferRequest | None, message: str) -> bytes:
    """An in-stream error, as Triton answers a failed request on a stream (echoing the request's
    id when it was read)."""
    echo = (
        pb.ModelInferResponse(id=sent.id, model_name=sent.model_name, model_version=sent.model_version)
        if sent is not None
        else pb.ModelInferResponse()
    )
    return pb.ModelStreamInferResponse(error_message=message, infer_response=echo).SerializeToString()
