"""Issue 40, item 2: half-sent unauthenticated gRPC calls must not starve other clients. An attacker
opens more unary calls than a worker has HAProxy slots (1024), each with headers and no key, and
never finishes sending; a keyed victim's calls are still answered."""

from __future__ import annotations

import asyncio
import socket

import grpc
import grpc.aio
import pytest
from tritonclient.grpc import service_pb2 as pb

from gateway.state.auth import hash_key
from tests.gateway.conftest import gateway_config
from tests.gateway.test_data_plane import infer_request
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
INFER = "/inference.GRPCInferenceService/ModelInfer"
KEY = "sk-victim-half-sent-0123456789"
HALF_SENT = 1200  # above one worker's 1024 HAProxy slots
PER_CHANNEL = 100  # HTTP/2 streams per connection HAProxy allows


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


HEADERS_BLOCK = b"".join(
    _literal(k, v)
    for k, v in (
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", INFER.encode()),
        (b":authority", b"gw"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    )
)


def _half_sent_connection(address: str) -> socket.socket:
    """An HTTP/2 connection with PER_CHANNEL calls opened (headers, no key, no END_STREAM) that
    the client never finishes nor resets: a raw client, as an attacker writes one."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    frames = [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"]
    for i in range(PER_CHANNEL):
        stream_id = 1 + 2 * i
        frames.append(
            len(HEADERS_BLOCK).to_bytes(3, "big") + b"\x01\x04" + stream_id.to_bytes(4, "big") + HEADERS_BLOCK
        )
    # A PING last: its ACK means HAProxy has read every HEADERS frame before it (frames are
    # processed in order on a connection), so the calls are open when the victim starts.
    frames.append(b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"halfsent")
    s.sendall(b"".join(frames))
    return s


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(type, flags) of each whole HTTP/2 frame in `data` (after no preface: a server sends none)."""
    out, at = [], 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        if at + 9 + length > len(data):
            break
        out.append((data[at + 3], data[at + 4]))
        at += 9 + length
    return out


def _pinged_back(flood: list[socket.socket], seen: list[bytes]) -> bool:
    """Whether every flood connection has its PING acknowledged (read without waiting)."""
    for i, s in enumerate(flood):
        s.setblocking(False)
        try:
            while chunk := s.recv(65536):
                seen[i] += chunk
        except (BlockingIOError, ConnectionError):
            pass
    return all((6, 1) in _frames(b) for b in seen)


def test_half_sent_unauthenticated_calls_leave_room_for_keyed_callers(one_triton, make_gateway) -> None:
    gw = make_gateway(
        gateway_config(
            one_triton,
            listen={"workers": 1},
            auth={"keys": [{"name": "victim", "sha256": hash_key(KEY)}]},
            cache={"backend": "none"},
        )
    )

    flood = [_half_sent_connection(gw.grpc) for _ in range(HALF_SENT // PER_CHANNEL)]

    async def main() -> list[str]:
        async with grpc.aio.insecure_channel(gw.grpc) as victim:
            infer = victim.unary_unary(
                INFER,
                request_serializer=pb.ModelInferRequest.SerializeToString,
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            outcomes = []
            for _ in range(10):
                try:
                    answer = await infer(infer_request(), timeout=20, metadata=(("x-api-key", KEY),))
                    outcomes.append("ok" if answer.outputs else "empty")
                except grpc.aio.AioRpcError as exc:
                    outcomes.append(exc.code().name)
            return outcomes

    try:
        seen = [b""] * len(flood)
        wait_until(lambda: _pinged_back(flood, seen), 60, "HAProxy to have read every half-sent call")
        outcomes = asyncio.run(main())
    finally:
        for s in flood:
            s.close()
    assert outcomes == ["ok"] * 10
