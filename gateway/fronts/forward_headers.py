"""Request headers the gateway passes on to Triton, checked first."""

from __future__ import annotations

import re

from gateway.errors import BadRequest

# Forwarded headers Triton must be able to read: bounded, printable ASCII, each sent once. Anything
# else would make Triton drop the connection, which the gateway would count against the server.
_MAX_FORWARDED_HEADER = 256
_FORWARDED_NAMES = {b"content-type": "Content-Type", b"accept-encoding": "Accept-Encoding"}


_UNPRINTABLE = re.compile(rb"[^\x20-\x7e]")


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
