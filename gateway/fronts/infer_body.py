"""Reading an HTTP inference request body the way Triton reads it.

The gateway reads a request body only to key the cache, enforce the batch limit, learn the
client's `timeout` and `sequence_id`, and forward the remaining deadline. Whatever it reads must
be exactly what Triton reads, or a client could make the gateway key one request and Triton answer
another (cache poisoning). So:

- Content-Encoding gzip/deflate is inflated here (Triton accepts both), bounded by the request size
  limit; the inflated bytes are what is keyed, parsed and forwarded.
- Duplicate object keys are refused at every level: Triton's parser (RapidJSON) takes the first
  occurrence, Python's `json` the last.
- Large headers are walked by the exact reader (gateway/fronts/exact_json.py), in a worker thread
  above OFF_LOOP_BYTES; it stays interpreted so that the walk gives the event loop the GIL back.
  This module is compiled (gateway/compiled_build.py): every request runs it.
- Small headers (every binary-protocol header, small JSON) are parsed in C and keyed on one
  canonical serialisation of the parsed dict; a request whose answer is cached is forwarded in that
  form (Triton reads what was keyed), others as received with the deadline spliced in. They are read
  by orjson when it reads exactly what the exact reader (`json` with hooks) reads (`_loads_fast`:
  about 10x faster), and by the exact reader otherwise, which also names what is wrong.
- In larger ones, tensor `data` arrays are not decoded at all: their exact text is located (one
  regex scan for numeric arrays), hashed and forwarded as received, never re-serialised.

Validation errors name the field (`inputs[0].shape`), never a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from typing import Any, Final

import orjson

from gateway.errors import BadRequest, RequestTooLarge, UnsupportedEncoding
from gateway.fronts.exact_json import (
    Overflow,
    RawData,
    Walker,
    kind,
    loads_small,
    numbers_only,
    too_many,
    walk,
)
from gateway.fronts.json_depth import MAX_DEPTH, may_nest_deeper_than

# Above this many bytes, walking happens in a worker thread (asyncio.to_thread costs ~0.1 ms;
# walking 64 KiB of string tensors on the loop about as much as that, numbers far less).
OFF_LOOP_BYTES: Final = 64 * 1024
# Headers up to this size (every binary-protocol header, small JSON) are parsed by `json` in C and
# keyed on their canonical serialisation (forwarded so when the answer is cached).
CANONICAL_BYTES: Final = 16 * 1024
# Default of limits.max_tensors: inputs, outputs and parameters per request (and per tensor).
MAX_TENSORS: Final = 256
# Default of limits.max_inflate_ratio, and the inflated size always allowed whatever the ratio.
MAX_INFLATE_RATIO: Final = 100.0
INFLATE_FLOOR: Final = 1 << 20
# Triton reads `timeout` and `sequence_id` as unsigned 64-bit integers.
MAX_UINT64: Final = 2**64 - 1
# Parameters that address Triton's shared-memory extension, which the gateway does not expose:
# forwarded, they would read another tenant's registered region.
SHARED_MEMORY_PARAMETERS: Final = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


def _int_field(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _validate(header: dict[str, Any], max_tensors: int = MAX_TENSORS) -> None:
    """Types of the fields the gateway or Triton read, and their counts; each error names the field."""
    if "id" in header and not isinstance(header["id"], str):
        raise BadRequest(f"id must be a string, got {kind(header['id'])}")
    params = header.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise BadRequest(f"parameters must be an object, got {kind(params)}")
        if len(params) > max_tensors:
            raise too_many("parameters", "entries", max_tensors)
        if "timeout" in params:
            t = params["timeout"]
            # Beyond uint64 Triton cannot read it, and the deadline arithmetic would overflow.
            if not _int_field(t) or not 0 <= t <= MAX_UINT64:
                raise BadRequest(
                    "parameters.timeout must be a non-negative integer of microseconds, got "
                    f"{_shown(t)} (at most 2^64-1)"
                )
        if "sequence_id" in params:
            seq = params["sequence_id"]
            if not (_int_field(seq) and 0 <= seq <= MAX_UINT64) and not isinstance(seq, str):
                raise BadRequest(
                    "parameters.sequence_id must be a non-negative integer or a string, got "
                    f"{_shown(seq)} (integers at most 2^64-1)"
                )
    for section in ("inputs", "outputs"):
        if section not in header:
            continue
        items = header[section]
        if not isinstance(items, list):
            raise BadRequest(f"{section} must be an array of objects, got {kind(items)}")
        if len(items) > max_tensors:
            raise too_many("the request", section, max_tensors)
        for n, item in enumerate(items):
            where = f"{section}[{n}]"
            if not isinstance(item, dict):
                raise BadRequest(f"{where} must be an object, got {kind(item)}")
            if "name" in item and not isinstance(item["name"], str):
                raise BadRequest(f"{where}.name must be a string, got {kind(item['name'])}")
            if "parameters" in item:
                tensor_params = item["parameters"]
                if not isinstance(tensor_params, dict):
                    raise BadRequest(f"{where}.parameters must be an object, got {kind(tensor_params)}")
                if len(tensor_params) > max_tensors:
                    raise too_many(f"{where}.parameters", "entries", max_tensors)
                for name in SHARED_MEMORY_PARAMETERS:
                    if name in tensor_params:
                        raise BadRequest(
                            f"{where}.parameters.{name}: the gateway does not expose Triton's "
                            "shared-memory extension; send tensor data in the request"
                        )
            if section == "inputs":
                if "data" in item and not isinstance(item["data"], (list, RawData)):
                    raise BadRequest(f"{where}.data must be a JSON array")
                if "datatype" in item and not isinstance(item["datatype"], str):
                    raise BadRequest(f"{where}.datatype must be a string, got {kind(item['datatype'])}")
                shape = item.get("shape")
                if "shape" in item and (
                    not isinstance(shape, list) or not all(_int_field(d) and d >= 0 for d in shape)
                ):
                    raise BadRequest(
                        f"{where}.shape must be an array of non-negative integers, got {shape!r}"[:300]
                    )


class InferBody:
    """One parsed inference request: the header, its tensor bytes, and what the gateway acts on."""

    __slots__ = (
        "body",
        "header_length",
        "header",
        "text",
        "request_id",
        "timeout_us",
        "sequence_id",
        "_spans",
        "_splice",
    )

    def __init__(
        self,
        body: bytes,
        header_length: int | None,
        text: str,
        header: dict[str, Any],
        walker: Walker | None,
    ) -> None:
        """`walker` None: a small header, keyed canonically (see `with_timeout`)."""
        self.body = body  # as received (inflated if the client compressed it)
        self.header_length = header_length
        self.text = text
        self.header = header
        self.request_id: str = header.get("id", "")
        params = header.get("parameters") or {}
        self.timeout_us: int | None = params.get("timeout")
        # Requests of a stateful model's sequence must stay on one server (no retry elsewhere, no hedge).
        self.sequence_id: int | str | None = params.get("sequence_id")
        self._spans = walker.data if walker is not None else []
        self._splice = walker

    @property
    def sticky(self) -> bool:
        """Whether the request belongs to a sequence (Triton reads 0 and "" as "no sequence")."""
        return self.sequence_id not in (None, 0, "")

    def batch_sizes(self) -> list[tuple[str, int]]:
        out = []
        for inp in self.header.get("inputs", []):
            shape = inp.get("shape") or [0]
            out.append((str(inp.get("name")), shape[0]))
        return out

    def key_material(self) -> tuple[bytes, bytes]:
        """(canonical header without `id`, tensor bytes) for the cache key.

        The header is canonical JSON (sorted keys; duplicates were refused, so the dict is exactly
        what Triton reads). Each `data` array stands in it as {"raw-bytes": n} and its exact text
        follows in the tensor bytes, then the binary tail: `data` can only be an array, so no client
        header can spell that placeholder at that place.
        """
        tail = self.body[self.header_length :] if self.header_length is not None else b""
        w = self._splice
        if w is None:
            header = {k: v for k, v in self.header.items() if k != "id"}
            return canonical_json(header, sort_keys=True), tail
        # Forwarded as received, so keyed on exactly the text Triton reads (two texts that parse to
        # equal Python values, e.g. 0.1 and 0.10000000000000000001, may differ to Triton): only the
        # `id` value is blanked, since every request has its own.
        text = self.text
        if w.id_span is not None:
            text = text[: w.id_span[0]] + '""' + text[w.id_span[1] :]
        return text.encode(), tail

    @property
    def keyed_on_text(self) -> bool:
        """Whether `key_material` is the exact header text (large headers) rather than canonical JSON."""
        return self._splice is not None

    def with_timeout(self, timeout_s: float, canonical: bool = False) -> tuple[bytes, int | None]:
        """The body with the remaining deadline as Triton's `timeout` parameter (microseconds).

        A smaller timeout the client sent is kept. The parameter is spliced into the exact bytes
        received (no re-serialisation); returns (body, new header length or None). `canonical`:
        a small header is re-serialised instead, as `key_material` keys it (a cached answer must
        answer what was keyed: number texts that parse alike here may differ to Triton).
        """
        us = max(1, int(timeout_s * 1e6))
        keep = bool(self.timeout_us) and self.timeout_us <= us  # type: ignore[operator]  # 0: "none"
        w = self._splice
        if w is None:
            header = self.header
            if keep and not canonical:
                return self.body, self.header_length
            if "parameters" not in header and not canonical:
                # Spliced after the opening brace of the bytes received: no re-serialisation.
                at = self.body.index(b"{") + 1
                spliced = b'"parameters":{"timeout":%d}%s' % (us, b"," if header else b"")
                body = self.body[:at] + spliced + self.body[at:]
                return body, (None if self.header_length is None else self.header_length + len(spliced))
            if not keep:
                header = {**header, "parameters": {**header.get("parameters", {}), "timeout": us}}
            data = canonical_json(header)
            if self.header_length is None:
                return data, None
            return data + self.body[self.header_length :], len(data)
        if keep:
            return self.body, self.header_length
        if w.timeout_span is not None:
            start, end, insert = w.timeout_span[0], w.timeout_span[1], str(us)
        elif w.params_open >= 0:
            start = end = w.params_open
            insert = f'"timeout":{us}' + ("" if w.params_empty else ",")
        else:
            start = end = w.top_open
            insert = f'"parameters":{{"timeout":{us}}}' + ("" if w.top_empty else ",")
        b_start, b_end = self._byte_offset(start), self._byte_offset(end)
        body = self.body[:b_start] + insert.encode() + self.body[b_end:]
        grown = len(body) - len(self.body)
        return body, (None if self.header_length is None else self.header_length + grown)

    def _byte_offset(self, char_offset: int) -> int:
        if self.text.isascii():
            return char_offset
        return len(self.text[:char_offset].encode())


# What Python's JSON reader accepts and Triton's (RapidJSON) refuses, with HTTP 500 that would count
# against a healthy server: a high surrogate escape without its low one, and numbers beyond a double.
# An escape counts only after an even run of backslashes ("\\ud800" is text, not an escape).
_SURROGATE_ESCAPE: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u([dD][89a-fA-F][0-9a-fA-F]{2})")
# A cheap over-estimate of fractions that may not fit a double: an exponent of 3+ digits, or 309+ digits.
_MAY_OVERFLOW: Final = re.compile(r"[eE][+]?0*[1-9][0-9]{2}|[0-9]{309}")


# Floats this large may have been integer texts past 64 bits, which orjson reads as floats (`json`
# as ints): such a header goes to the exact reader.
_INTEGER_RANGE: Final = 2.0**63


def _loads_fast(raw: bytes, text: str) -> dict[str, Any] | None:
    """The header as the exact reader would read it, by orjson; None when orjson might read it
    differently or not at all (the exact reader then reads it, or names what is wrong).

    orjson keeps the last of duplicate keys where the exact reader refuses them. A duplicate pair
    dropped from the parsed value takes at least its own colon with it, so the parsed value holds
    fewer colons (one per key, and those inside its strings) than the text; without duplicates the
    counts are equal, since every colon is a key's or inside a string and both survive. A `\\u`
    escape could spell a colon inside a string, so text with escapes goes to the exact reader.
    """
    if _escapes(text):
        return None
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    # -1 (never a count) when nested deeper than MAX_DEPTH, or holding a float past 2^63.
    if not isinstance(header, dict) or _colons(header, MAX_DEPTH) != text.count(":"):
        return None
    return header


def _colons(value: object, room: int) -> int:
    """The colons `value` written as JSON would hold (one per object key, and those in its strings),
    counted without writing it (numbers cost most to write); -1 when the exact reader might read
    its text otherwise: containers nested more than `room` deep (the walk names where), or a float
    that may have been an integer past 64 bits."""
    if isinstance(value, float):
        return -1 if abs(value) >= _INTEGER_RANGE else 0
    if isinstance(value, str):
        return value.count(":")
    if isinstance(value, dict):
        if room == 0:
            return -1
        n = len(value)
        for key, item in value.items():
            inner = _colons(item, room - 1)
            if inner < 0:
                return -1
            name: str = key  # JSON keys are text: typed, the count is a native call
            n += name.count(":") + inner
        return n
    if isinstance(value, list):
        if room == 0:
            return -1
        n = 0
        for item in value:
            # Tensor data is mostly numbers: checked here, without a call per element.
            if isinstance(item, float):
                if abs(item) >= _INTEGER_RANGE:
                    return -1
            elif not isinstance(item, int):
                inner = _colons(item, room - 1)
                if inner < 0:
                    return -1
                n += inner
        return n
    return 0


def canonical_json(value: Any, sort_keys: bool = False) -> bytes:
    """Compact JSON of a parsed header (orjson; integers beyond 64 bits, which only the exact reader
    yields, by `json`)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except orjson.JSONEncodeError:
        # ASCII escapes: orjson refuses what may be in it, a lone surrogate escape Triton passes on.
        return json.dumps(value, sort_keys=sort_keys, separators=(",", ":")).encode()


def _overflow(exc: Overflow) -> BadRequest:
    return BadRequest(
        f"the request JSON has the number {str(exc)[:40]}, beyond a 64-bit float; Triton refuses it"
    )


def _escapes(text: str) -> bool:
    """Whether `text` holds a `\\u` escape. Most headers hold no backslash at all, and a one-character
    search is a memchr: a tenth of the two-character search's cost."""
    return "\\" in text and "\\u" in text


def check_triton_json(text: str, numbers: bool = True) -> None:
    """BadRequest for JSON Triton refuses but Python reads: a lone high surrogate escape, or (with
    `numbers`) a number beyond a double (Python reads 1e999 as inf and would forward it as "Infinity")."""
    if _escapes(text):
        # RapidJSON refuses a high surrogate escape not followed at once by a low one; a lone low
        # one it passes on (so "\\udc00\\ud800" still has an unpaired high one).
        high: re.Match[str] | None = None
        for m in _SURROGATE_ESCAPE.finditer(text):
            at = m.start(1) - 2
            if high is not None:
                if int(m.group(1), 16) >= 0xDC00 and at == high.end():
                    high = None
                    continue
                break
            if int(m.group(1), 16) < 0xDC00:
                high = m
        if high is not None:
            raise BadRequest(
                f"the request JSON has an unpaired surrogate escape \\u{high.group(1)} at character "
                f"{high.start(1) - 2}; send UTF-8 text or a surrogate pair (Triton refuses it)"
            )
    if numbers and _MAY_OVERFLOW.search(text):
        try:
            numbers_only(text)
        except Overflow as exc:
            raise _overflow(exc) from None
        except (ValueError, RecursionError):
            pass  # malformed or deep: the walk names what is wrong


def parse_header_length(value: bytes | None) -> int | None:
    """Inference-Header-Content-Length: absent, or a non-negative decimal integer."""
    if value is None:
        return None
    shown = value.decode("latin-1")
    stripped = value.strip()
    if stripped.startswith(b"-") and stripped[1:].isdigit():
        raise BadRequest(f"Inference-Header-Content-Length must not be negative, got {shown!r}")
    if not stripped.isdigit():
        raise BadRequest(f"Inference-Header-Content-Length must be an integer, got {shown[:40]!r}")
    if len(stripped) > 19:  # more than any body size; int() of thousands of digits is refused or slow
        raise BadRequest(
            f"Inference-Header-Content-Length has {len(stripped)} digits; it must be at most 19 "
            "(a byte count within the body)"
        )
    return int(stripped)


def inflate_cap(compressed: int, limit: int, ratio: float = MAX_INFLATE_RATIO) -> int:
    """Most bytes `compressed` bytes may inflate to: `ratio` times, at least INFLATE_FLOOR, at most `limit`."""
    return min(limit, max(INFLATE_FLOOR, int(compressed * ratio)))


def inflate(body: bytes, encoding: str, limit: int, ratio: float = MAX_INFLATE_RATIO) -> bytes:
    """Undo Content-Encoding gzip/deflate (as Triton does), refusing more than `limit` inflated bytes
    or more than `ratio` times the compressed size (a few KiB must not become `limit` bytes)."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return body
    if enc == "gzip":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif enc == "deflate":
        d = zlib.decompressobj(zlib.MAX_WBITS)  # HTTP "deflate" is the zlib format (RFC 9110 8.4.1.2)
    else:
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or identity"
        )
    cap = inflate_cap(len(body), limit, ratio)
    try:
        out = d.decompress(body, cap + 1)
    except zlib.error as exc:
        raise BadRequest(f"the request body is not valid {enc} data ({exc})") from None
    if len(out) > cap:
        if cap == limit:
            raise RequestTooLarge(
                f"the {enc} request body inflates to more than the limit of {limit} bytes (limits.max_request_bytes)"
            )
        raise RequestTooLarge(
            f"the {enc} request body of {len(body)} bytes inflates to more than {ratio:g} times its size "
            f"(limits.max_inflate_ratio); send it uncompressed or less compressible"
        )
    if not d.eof:
        raise BadRequest(f"the {enc} request body is truncated")
    if d.unused_data:
        raise BadRequest(f"the {enc} request body has {len(d.unused_data)} bytes after the compressed stream")
    return out


def parse_infer_body(
    body: bytes,
    header_length: int | None,
    encoding: str | None = None,
    limit: int = 64 << 20,
    canonical_bytes: int | None = None,
    max_tensors: int = MAX_TENSORS,
    inflate_ratio: float = MAX_INFLATE_RATIO,
) -> InferBody:
    """Inflate (if encoded), parse and validate one request body; BadRequest names what is wrong.

    `limit` bounds the inflated size (limits.max_request_bytes); headers under `canonical_bytes`
    (default CANONICAL_BYTES) are forwarded re-serialised, larger ones as received."""
    if encoding is not None:
        body = inflate(body, encoding, limit, inflate_ratio)
    if header_length is not None and header_length > len(body):
        raise BadRequest(f"Inference-Header-Content-Length {header_length} exceeds the body size {len(body)}")
    raw = body if header_length is None else body[:header_length]
    try:
        text = raw.decode("utf-8")  # Triton reads UTF-8 only (Python's json would guess UTF-16/32)
    except UnicodeDecodeError as undecodable:
        raise BadRequest(f"the request JSON is not valid UTF-8 at byte {undecodable.start}") from None
    small = len(text) < (CANONICAL_BYTES if canonical_bytes is None else canonical_bytes)
    check_triton_json(text, numbers=not small)
    if small:
        fast = _loads_fast(raw, text)
        if fast is not None:
            _validate(fast, max_tensors)
            return InferBody(body, header_length, text, fast, None)
        # Deep headers go to the walk, which names where the nesting passes the limit.
        deep = may_nest_deeper_than(text, MAX_DEPTH)
        try:
            header = loads_small(text)
        except Overflow as exc:
            raise _overflow(exc) from None
        except (ValueError, RecursionError):
            check_triton_json(text)  # the walk below names what else is wrong
        else:
            if isinstance(header, dict) and not deep:
                _validate(header, max_tensors)
                return InferBody(body, header_length, text, header, None)
    header, walker = walk(text, small=len(text) < OFF_LOOP_BYTES, max_tensors=max_tensors)
    _validate(header, max_tensors)
    return InferBody(body, header_length, text, header, walker)


async def inflate_async(body: bytes, encoding: str, limit: int, ratio: float = MAX_INFLATE_RATIO) -> bytes:
    """`inflate`, in a worker thread when more than a few KiB could come out of it."""
    if inflate_cap(len(body), limit, ratio) <= OFF_LOOP_BYTES:
        return inflate(body, encoding, limit, ratio)
    return await asyncio.to_thread(inflate, body, encoding, limit, ratio)


async def parse_infer_body_async(
    body: bytes,
    header_length: int | None,
    encoding: str | None = None,
    limit: int = 64 << 20,
    max_tensors: int = MAX_TENSORS,
    inflate_ratio: float = MAX_INFLATE_RATIO,
) -> InferBody:
    """`parse_infer_body`, in a worker thread when the header is large or the body compressed
    (a few compressed bytes can inflate to `limit`)."""
    size = len(body) if header_length is None else header_length
    if size < OFF_LOOP_BYTES and encoding is None:
        return parse_infer_body(body, header_length, None, limit, None, max_tensors, inflate_ratio)
    args = (body, header_length, encoding, limit, None, max_tensors, inflate_ratio)
    return await asyncio.to_thread(parse_infer_body, *args)
