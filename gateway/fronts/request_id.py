"""Request ids a client sends (`x-request-id` header or gRPC metadata): checked before use.

The id travels on to Triton as metadata and into logs; gRPC metadata values must be printable
ASCII, and an unbounded id would grow every log line and upstream header. A bad id is the client's
error: 400 / INVALID_ARGUMENT naming the header, never an INTERNAL from the upstream call.
"""

from __future__ import annotations

import random
from typing import Final

from gateway.errors import BadRequest

MAX_REQUEST_ID: Final = 128


def is_valid_request_id(value: str) -> bool:
    return 0 < len(value) <= MAX_REQUEST_ID and all(" " <= c <= "~" for c in value)


def checked_request_id(value: str | None) -> str:
    """The client's id if valid, a fresh one if none was sent; BadRequest naming x-request-id otherwise."""
    if value is None or value == "":
        return new_request_id()
    if not is_valid_request_id(value):
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise BadRequest(
            f"x-request-id must be 1-{MAX_REQUEST_ID} printable ASCII characters, got {len(value)} "
            f"characters starting {shown!r}"
        )
    return value


def new_request_id() -> str:
    # An id names a request in logs, it guards nothing: no urandom syscall per request for it.
    # 16 hex digits; bytes.hex is a third of a formatted int's cost (int.__format__ parses its spec).
    return random.getrandbits(64).to_bytes(8, "big").hex()
