"""Request headers the gateway passes on to Triton, checked first."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from gateway.errors import BadRequest

# Forwarded headers Triton must be able to read: bounded, printable ASCII, each sent once. Anything
# else would make Triton drop the connection, which the gateway would count against the server.
_MAX_FORWARDED_HEADER: Final = 256
_FORWARDED_NAMES: Final = {b"content-type": "Content-Type", b"accept-encoding": "Accept-Encoding"}


_UNPRINTABLE: Final = re.compile(rb"[^\x20-\x7e]")

# Never forwarded, whatever routing.header_forward_pattern says. Hop-by-hop headers (RFC 9110
# 7.6.1, and Keep-Alive/Proxy-Connection of RFC 2068) describe one connection, not the request:
# an `Expect: 100-continue` passed on makes Triton answer `100 Continue` first, which a proxy must
# never take for the answer. Keys and framing are the gateway's own to send.
NEVER_FORWARDED: Final = frozenset(
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
NEVER_FORWARDED_PREFIXES: Final = ("proxy-", "x-skewserve-")


# All forwarded headers of one request together: a proxy on the way (HAProxy's 16 KiB buffer for the
# gRPC plane) or Triton itself would refuse more, and its refusal would be taken for a server fault.
MAX_FORWARDED_BYTES: Final = 4096


def checked_forwarded_total(pairs: Iterable[tuple[str | bytes, str | bytes]]) -> None:
    """BadRequest when the forwarded headers together exceed MAX_FORWARDED_BYTES."""
    total = sum(len(k) + len(v) for k, v in pairs)
    if total > MAX_FORWARDED_BYTES:
        raise BadRequest(
            f"forwarded headers total {total} bytes, above the gateway's limit of {MAX_FORWARDED_BYTES}; "
            "send fewer or shorter headers matching routing.header_forward_pattern"
        )


def forwarded_metadata(
    md: Mapping[str, str | bytes], forwarded: Callable[[str], bool]
) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata passed on to Triton, each value checked as HTTP headers are (BadRequest,
    INVALID_ARGUMENT on gRPC, naming the key): a value Triton could not read would otherwise end
    the call as a transport error (a UnicodeEncodeError here, a 502 from HAProxy) counted against
    the server. Binary (`-bin`) metadata is never passed on: Triton forwards text parameters."""
    out = []
    for k, v in md.items():
        if not forwarded(k) or k.endswith("-bin") or not isinstance(v, str):
            continue
        try:
            raw = v.encode("ascii")
        except UnicodeEncodeError:
            raise BadRequest(f"{k} metadata must be printable ASCII, got {v[:40]!r}") from None
        out.append((k, checked_forward_header(k.encode(), raw).decode()))
    checked_forwarded_total(out)
    return tuple(out)


_TOKEN: Final = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")


def bound_header(name: str, value: str) -> tuple[str, str]:
    """A key's bound header (auth.keys[].headers), lower-cased; ValueError naming what is wrong."""
    lowered = name.lower()
    if not _TOKEN.match(lowered) or lowered.endswith("-bin"):
        raise ValueError(f"header name {name!r} is not a valid HTTP header / gRPC metadata name")
    if lowered in NEVER_FORWARDED or lowered.startswith(NEVER_FORWARDED_PREFIXES):
        raise ValueError(
            f"header {name!r} is never passed on to Triton (a key, hop-by-hop or the gateway's own)"
        )
    if len(value) > _MAX_FORWARDED_HEADER or _UNPRINTABLE.search(value.encode("latin-1", "replace")):
        raise ValueError(
            f"header {name!r}: the value must be printable ASCII of at most {_MAX_FORWARDED_HEADER} bytes"
        )
    return lowered, value


def checked_forward_header(name: bytes, value: bytes) -> bytes:
    """`value`, or BadRequest naming the header when Triton could not read it."""
    if len(value) > _MAX_FORWARDED_HEADER:
        raise BadRequest(
            f"{_shown(name)} header of {len(value)} bytes is longer than {_MAX_FORWARDED_HEADER}; "
            "send a standard value"
        )
    if _UNPRINTABLE.search(value) is not None:
        raise BadRequest(f"{_shown(name)} header must be printable ASCII, got {value[:40]!r}")
    return value


def _shown(name: bytes) -> str:
    """A header's name as an error shows it (only then: every request forwards some)."""
    return _FORWARDED_NAMES.get(name) or name.decode("latin-1")
