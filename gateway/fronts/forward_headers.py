"""Request headers the gateway passes on to Triton, checked first."""

from __future__ import annotations

import re

from gateway.errors import BadRequest

# Forwarded headers Triton must be able to read: bounded, printable ASCII, each sent once. Anything
# else would make Triton drop the connection, which the gateway would count against the server.
_MAX_FORWARDED_HEADER = 256
_FORWARDED_NAMES = {b"content-type": "Content-Type", b"accept-encoding": "Accept-Encoding"}


_UNPRINTABLE = re.compile(rb"[^\x20-\x7e]")

# Never forwarded, whatever routing.header_forward_pattern says. Hop-by-hop headers (RFC 9110
# 7.6.1, and Keep-Alive/Proxy-Connection of RFC 2068) describe one connection, not the request:
# an `Expect: 100-continue` passed on makes Triton answer `100 Continue` first, which a proxy must
# never take for the answer. Keys and framing are the gateway's own to send.
NEVER_FORWARDED = frozenset(
    {
        "authorization",
        "x-api-key",
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
        "http2-settings",
    }
)
# Proxy-Authorization, Proxy-Connection...; the gateway's own headers, which HAProxy and Triton
# would otherwise take as the gateway's word (x-skewserve-peer, -target-ip, -target-port).
NEVER_FORWARDED_PREFIXES = ("proxy-", "x-skewserve-")


def checked_forward_header(name: bytes, value: bytes) -> bytes:
    """`value`, or BadRequest naming the header when Triton could not read it."""
    shown = _FORWARDED_NAMES.get(name, name.decode("latin-1"))
    if len(value) > _MAX_FORWARDED_HEADER:
        raise BadRequest(
            f"{shown} header of {len(value)} bytes is longer than {_MAX_FORWARDED_HEADER}; send a standard value"
        )
    if _UNPRINTABLE.search(value) is not None:
        raise BadRequest(f"{shown} header must be printable ASCII, got {value[:40]!r}")
    return value
