"""The worker end of the gRPC data plane, driven over its real unix socket with raw HTTP/1.1 as
HAProxy would send it (and as a client could shape it): request trailers never pass for the
headers HAProxy vouches for, a stalled message is cut off, and bytes being received are bounded."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.config import LimitsConfig
from gateway.errors import BridgeAbort
from gateway.fronts.grpc_bridge import BridgeServer, parse_grpc_timeout


async def _serve(path: Path, limits: LimitsConfig) -> BridgeServer:
    async def whoami(request: bytes, context: Any) -> bytes:
        return context.peer().encode() + b"|" + repr(context.time_remaining() is not None).encode()

    server = BridgeServer({"Who": whoami}, "test.Svc", limits)
    await server.start(path)
    return server


async def _exchange(path: Path, raw: bytes, wait_close: bool = False, responses: int = 1) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(raw)
    await writer.drain()
    data = b""
    while data.count(b"0\r\ngrpc-status") < responses or not data.endswith(b"\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        if not chunk:
            break
        data += chunk
    if wait_close:
        assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    return data


def _chunked(message: bytes, trailers: bytes = b"", head_extra: bytes = b"") -> bytes:
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    return (
        b"POST /test.Svc/Who HTTP/1.1\r\nhost: x\r\ncontent-type: application/grpc\r\n"
        b"x-skewserve-peer: 10.1.1.1\r\n" + head_extra + b"transfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(framed) + framed + b"\r\n0\r\n" + trailers + b"\r\n"
    )  # fmt: skip


def test_request_trailers_cannot_replace_the_peer_haproxy_set(tmp_path: Path) -> None:
    async def main() -> bytes:
        server = await _serve(tmp_path / "w.sock", LimitsConfig())
        try:
            return await _exchange(
                tmp_path / "w.sock",
                _chunked(b"hi", trailers=b"x-skewserve-peer: 6.6.6.6\r\ngrpc-timeout: 1n\r\n"),
            )
        finally:
            await server.stop()

    answer = asyncio.run(main())
    assert b"grpc-status: 0" in answer
    assert b"ipv4:10.1.1.1:0|False" in answer  # the header's peer; the trailer's deadline ignored too


def test_a_stalled_message_is_cut_off_and_big_ones_are_bounded(tmp_path: Path) -> None:
    limits = LimitsConfig(body_read_timeout_s=0.2, max_request_bytes=1000, max_buffered_body_bytes=1500)

    async def main() -> tuple[bytes, bytes, bytes]:
        server = await _serve(tmp_path / "w.sock", limits)
        try:
            head = (
                b"POST /test.Svc/Who HTTP/1.1\r\nhost: x\r\ncontent-type: application/grpc\r\n"
                b"transfer-encoding: chunked\r\n\r\n5\r\n\x00\x00\x00"
            )
            stalled = await _exchange(tmp_path / "w.sock", head, wait_close=True)
            # A refused request that ends leaves its connection reusable (HAProxy pools it): the
            # next request on it is served.
            big = await _exchange(tmp_path / "w.sock", _chunked(b"x" * 2000) + _chunked(b"ok"), responses=2)
            assert big.count(b"0\r\ngrpc-status: ") == 2 and big.rstrip().endswith(b"grpc-status: 0"), big
            # Two uploads at once, each within max_request_bytes, together above the buffer bound.
            part = b"x" * 900
            framed = b"\x00" + len(part).to_bytes(4, "big") + part
            opening = (
                b"POST /test.Svc/Who HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n" % 800 + framed[:800] + b"\r\n"
            )  # fmt: skip
        finally:
            await server.stop()
        # The bound part on its own server with a long read timeout: the first upload must still be
        # held, not cut off as stalled, when the second one arrives.
        patient = await _serve(tmp_path / "p.sock", limits.model_copy(update={"body_read_timeout_s": 30.0}))
        try:
            r1, w1 = await asyncio.open_unix_connection(str(tmp_path / "p.sock"))
            w1.write(opening)
            await w1.drain()
            async with asyncio.timeout(10):
                while patient.budget.held < 800:
                    await asyncio.sleep(0.01)
            second = await _exchange(tmp_path / "p.sock", opening, wait_close=True)
            w1.close()
            return stalled, big, second
        finally:
            await patient.stop()

    stalled, big, second = asyncio.run(main())
    assert b"grpc-status: %d" % grpc.StatusCode.DEADLINE_EXCEEDED.value[0] in stalled
    assert b"limits.body_read_timeout_s" in stalled
    assert b"grpc-status: %d" % grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] in big
    assert b"limits.max_request_bytes" in big
    assert b"limits.max_buffered_body_bytes" in second


def test_a_grpc_timeout_is_read_as_grpcs_spec_words_it() -> None:
    """1 to 8 ASCII digits and one unit letter (gRPC over HTTP/2, "Timeout"), read without a regex:
    the same values pass as the pattern `^([0-9]{1,8})([HMSmun])$` lets through, and the rest is
    refused by name."""
    spec = re.compile(r"([0-9]{1,8})([HMSmun])")
    units = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
    values = ["1n", "0S", "5S", "100m", "99999999H", "00000001u", "7M"]
    bad = ["", "S", "5", "123456789S", "1x", "1s", "-1S", "1.5S", " 1S", "1S ", "１S", "²S", "1SS", "m5"]
    for value in values:
        match = spec.fullmatch(value)
        assert match is not None and parse_grpc_timeout(value) == int(match.group(1)) * units[match.group(2)]
    for value in bad:
        assert spec.fullmatch(value) is None
        with pytest.raises(BridgeAbort) as refused:
            parse_grpc_timeout(value)
        assert (
            refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "grpc-timeout" in refused.value.details
        )
