"""Reading an HTTP inference request body the way Triton reads it.

The gateway reads a request body only to key the cache, enforce the batch limit, learn the
client's `timeout` and `sequence_id`, and forward the remaining deadline. Whatever it reads must
be exactly what Triton reads, or a client could make the gateway key one request and Triton answer
another (cache poisoning). So:

- Content-Encoding gzip/deflate is inflated here (Triton accepts both), bounded by the request size
  limit; the inflated bytes are what is keyed, parsed and forwarded.
- Duplicate object keys are refused at every level: Triton's parser (RapidJSON) takes the first
  occurrence, Python's `json` the last.
- The walk is a small recursive descent over the header in which every container element passes
  through Python code, so a large body walked in a worker thread gives the event loop the GIL back
  at the interpreter's switch interval (a single C-level `json.loads` of 9 MB holds it for ~1 s).
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
import json.decoder
import math
import re
import zlib
from typing import Any

import orjson

from gateway.errors import BadRequest, RequestTooLarge, UnsupportedEncoding

# Above this many bytes, walking happens in a worker thread (asyncio.to_thread costs ~0.1 ms;
# walking 64 KiB of string tensors on the loop about as much as that, numbers far less).
OFF_LOOP_BYTES = 64 * 1024
# Headers up to this size (every binary-protocol header, small JSON) are parsed by `json` in C and
# keyed on their canonical serialisation (forwarded so when the answer is cached).
CANONICAL_BYTES = 16 * 1024
# Deeper structure than any KServe request has; RapidJSON in Triton recurses per level.
MAX_DEPTH = 32
# Default of limits.max_tensors: inputs, outputs and parameters per request (and per tensor).
MAX_TENSORS = 256
# Default of limits.max_inflate_ratio, and the inflated size always allowed whatever the ratio.
MAX_INFLATE_RATIO = 100.0
INFLATE_FLOOR = 1 << 20
# Triton reads `timeout` and `sequence_id` as unsigned 64-bit integers.
MAX_UINT64 = 2**64 - 1
# Parameters that address Triton's shared-memory extension, which the gateway does not expose:
# forwarded, they would read another tenant's registered region.
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")

_WS = re.compile(r"[ \t\n\r]*")
# A data array made only of numbers, literals and nested arrays: the common case, skipped in one scan.
_PLAIN_ARRAY = re.compile(r"\[[-+.,0-9 \t\n\reEtrufalsn\[\]]*")
# Tokens that matter for bracket depth once strings appear: a whole string, or a bracket.
_ARRAY_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]]', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]]+")
_NOT_OPENER = re.compile(r"[^\[\]{}]+")
_scanstring: Any = json.decoder.scanstring  # type: ignore[attr-defined]  # C scanner, untyped


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Scalars only (strings, numbers, literals): containers are walked by `_Walker`.
_scan_scalar: Any = json.JSONDecoder(parse_constant=_refuse_constant).scan_once  # type: ignore[attr-defined]


class RawData:
    """An input's `data` array, kept as its exact text (start/end offsets into the header text)."""

    __slots__ = ("start", "end")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end


class _Duplicate(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


# Whole containers in one C call, refusing duplicate keys: only for bodies small enough for the loop.
_scan_small: Any = json.JSONDecoder(  # type: ignore[attr-defined]
    object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant
).scan_once


def _too_many(where: str, what: str, limit: int) -> BadRequest:
    return BadRequest(f"{where} has more than {limit} {what} (limits.max_tensors); send at most {limit}")


def _where(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "the request"


def _duplicate(key: str, path: tuple[str | int, ...]) -> BadRequest:
    where = f"in {_where(path)}" if path else "at the top level"
    return BadRequest(
        f"duplicate key {key!r} {where} of the request JSON; send each key once "
        "(Triton reads the first occurrence, so the request is ambiguous)"
    )


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


# What an object or array is to the gateway; the rest is walked generically.
_TOP, _INPUTS, _INPUT, _PARAMS, _OTHER = range(5)


def _brackets_deeper_than(text: str, limit: int) -> bool:
    """Whether balanced brackets in `text` (no strings in it) nest deeper than `limit`, in C-level
    passes: each pass removes the innermost pairs, so `limit` passes empty any shallower text."""
    brackets = _NOT_BRACKET.sub("", text)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace("[]", "")
    return bool(brackets)


class _Walker:
    """Recursive descent over the JSON header text; positions are character offsets into it.

    `small` bodies scan uninteresting containers in one C call; large ones walk every container
    in Python so a worker thread running the walk yields the GIL to the event loop.
    """

    def __init__(self, text: str, small: bool, max_tensors: int = MAX_TENSORS) -> None:
        self.s = text
        self.n = len(text)
        self.small = small
        self.max_tensors = max_tensors
        self.data: list[RawData] = []
        # The top-level `id` value: blanked in the cache key (every request has its own id).
        self.id_span: tuple[int, int] | None = None
        # Where the top-level object and its "parameters" sit, for splicing a timeout in later.
        self.top_open = -1
        self.top_empty = False
        self.params_open = -1
        self.params_empty = False
        self.timeout_span: tuple[int, int] | None = None

    def ws(self, i: int) -> int:
        if i < self.n and self.s[i] in " \t\n\r":
            m = _WS.match(self.s, i)
            assert m is not None
            return m.end()
        return i

    def fail(self, what: str, i: int) -> BadRequest:
        return BadRequest(f"the request JSON is malformed: {what} at offset {i}")

    def value(self, i: int, path: tuple[str | int, ...], role: int) -> tuple[Any, int]:
        if len(path) > MAX_DEPTH:
            raise BadRequest(f"the request JSON nests deeper than {MAX_DEPTH} levels at {_where(path)}")
        s = self.s
        if i >= self.n:
            raise self.fail(f"missing value for {_where(path)}", i)
        c = s[i]
        if c == "{" or c == "[":
            if role == _OTHER and self.small:
                try:
                    scanned, end = _scan_small(s, i)
                except _Duplicate as dup:
                    raise _duplicate(dup.key, path) from None
                except RecursionError:
                    raise BadRequest(f"the request JSON nests too deeply at {_where(path)}") from None
                except (StopIteration, ValueError) as bad:
                    raise self.fail(f"invalid value for {_where(path)} ({bad})", i) from None
                # Deeper than the limit: walked below, which counts the levels and names the place.
                if not _may_nest_deeper_than(s[i:end], MAX_DEPTH - len(path)):
                    return scanned, end
            if c == "{":
                return self.obj(i, path, role)
            return self.arr(i, path, role)
        try:
            return _scan_scalar(s, i)  # type: ignore[no-any-return]
        except StopIteration:
            raise self.fail(f"invalid value for {_where(path)}", i) from None
        except ValueError as exc:
            raise self.fail(f"invalid value for {_where(path)} ({exc})", i) from None

    def obj(self, i: int, path: tuple[str | int, ...], role: int) -> tuple[dict[str, Any], int]:
        s = self.s
        out: dict[str, Any] = {}
        opened = i + 1
        i = self.ws(opened)
        empty = i < self.n and s[i] == "}"
        if role == _TOP:
            self.top_open, self.top_empty = opened, empty
        elif role == _PARAMS:
            self.params_open, self.params_empty = opened, empty
        if empty:
            return out, i + 1
        while True:
            if i >= self.n or s[i] != '"':
                raise self.fail(f"expected a key string in {_where(path)}", i)
            try:
                key, i = _scanstring(s, i + 1, True)
            except ValueError as exc:
                raise self.fail(f"bad key string in {_where(path)} ({exc})", i) from None
            if key in out:
                raise _duplicate(key, path)
            # Counted as they come, so a million-key object is refused at its 257th key.
            if len(out) >= self.max_tensors and path and path[-1] == "parameters":
                raise _too_many(_where(path), "entries", self.max_tensors)
            i = self.ws(i)
            if i >= self.n or s[i] != ":":
                raise self.fail(f"expected ':' after key {key!r}", i)
            i = self.ws(i + 1)
            if role == _INPUT and key == "data":
                out[key], i = self.data_array(i, (*path, key))
            elif role == _TOP and key in ("inputs", "parameters"):
                out[key], i = self.value(i, (key,), _INPUTS if key == "inputs" else _PARAMS)
            else:
                start = i
                out[key], i = self.value(i, (*path, key), _OTHER)
                if role == _PARAMS and key == "timeout":
                    self.timeout_span = (start, i)
                elif role == _TOP and key == "id":
                    self.id_span = (start, i)
            i = self.ws(i)
            if i < self.n and s[i] == ",":
                i = self.ws(i + 1)
                continue
            if i < self.n and s[i] == "}":
                return out, i + 1
            raise self.fail(f"expected ',' or '}}' in {_where(path)}", i)

    def arr(self, i: int, path: tuple[str | int, ...], role: int) -> tuple[list[Any], int]:
        s = self.s
        out: list[Any] = []
        item_role = _INPUT if role == _INPUTS else _OTHER
        i = self.ws(i + 1)
        if i < self.n and s[i] == "]":
            return out, i + 1
        counted = len(path) == 1 and path[0] in ("inputs", "outputs")
        while True:
            if counted and len(out) >= self.max_tensors:
                raise _too_many("the request", str(path[0]), self.max_tensors)
            item, i = self.value(i, (*path, len(out)), item_role)
            out.append(item)
            i = self.ws(i)
            if i < self.n and s[i] == ",":
                i = self.ws(i + 1)
                continue
            if i < self.n and s[i] == "]":
                return out, i + 1
            raise self.fail(f"expected ',' or ']' in {_where(path)}", i)

    def data_array(self, i: int, path: tuple[str | int, ...]) -> tuple[RawData, int]:
        """Locate an input's `data` array without decoding it; Triton validates the values."""
        s = self.s
        if i >= self.n or s[i] != "[":
            raise BadRequest(f"{_where(path)} must be a JSON array")
        m = _PLAIN_ARRAY.match(s, i)
        assert m is not None  # the pattern matches the '[' itself
        end = s.rfind("]", i, m.end()) + 1
        # In valid JSON a run of plain characters cannot reach past the array's own closing bracket
        # (a key's quote or a '}' follows it), so a balanced run ends exactly at that bracket.
        opened = s.count("[", i, end)
        if end > i and opened == s.count("]", i, end):
            if opened > 1 and _brackets_deeper_than(s[i:end], MAX_DEPTH):
                raise BadRequest(f"{_where(path)} nests deeper than {MAX_DEPTH} levels")
            raw = RawData(i, end)
        else:
            raw = RawData(i, self._skip_with_strings(i, path))
        self.data.append(raw)
        return raw, raw.end

    def _skip_with_strings(self, i: int, path: tuple[str | int, ...]) -> int:
        depth = 0
        for m in _ARRAY_TOKEN.finditer(self.s, i):
            c = m.group()
            if c == "[":
                depth += 1
                if depth > MAX_DEPTH:
                    raise BadRequest(f"{_where(path)} nests deeper than {MAX_DEPTH} levels")
            elif c == "]":
                depth -= 1
                if depth == 0:
                    return m.end()
        raise self.fail(f"unterminated array in {_where(path)}", i)


def _int_field(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _validate(header: dict[str, Any], max_tensors: int = MAX_TENSORS) -> None:
    """Types of the fields the gateway or Triton read, and their counts; each error names the field."""
    if "id" in header and not isinstance(header["id"], str):
        raise BadRequest(f"id must be a string, got {_kind(header['id'])}")
    params = header.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise BadRequest(f"parameters must be an object, got {_kind(params)}")
        if len(params) > max_tensors:
            raise _too_many("parameters", "entries", max_tensors)
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
            raise BadRequest(f"{section} must be an array of objects, got {_kind(items)}")
        if len(items) > max_tensors:
            raise _too_many("the request", section, max_tensors)
        for n, item in enumerate(items):
            where = f"{section}[{n}]"
            if not isinstance(item, dict):
                raise BadRequest(f"{where} must be an object, got {_kind(item)}")
            if "name" in item and not isinstance(item["name"], str):
                raise BadRequest(f"{where}.name must be a string, got {_kind(item['name'])}")
            if "parameters" in item:
                tensor_params = item["parameters"]
                if not isinstance(tensor_params, dict):
                    raise BadRequest(f"{where}.parameters must be an object, got {_kind(tensor_params)}")
                if len(tensor_params) > max_tensors:
                    raise _too_many(f"{where}.parameters", "entries", max_tensors)
                for name in SHARED_MEMORY_PARAMETERS:
                    if name in tensor_params:
                        raise BadRequest(
                            f"{where}.parameters.{name}: the gateway does not expose Triton's "
                            "shared-memory extension; send tensor data in the request"
                        )
            if section == "inputs":
                if "data" in item and not isinstance(item["data"], list | RawData):
                    raise BadRequest(f"{where}.data must be a JSON array")
                if "datatype" in item and not isinstance(item["datatype"], str):
                    raise BadRequest(f"{where}.datatype must be a string, got {_kind(item['datatype'])}")
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
        walker: _Walker | None,
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


def _may_nest_deeper_than(text: str, limit: int) -> bool:
    """Cheap over-estimate of nesting depth from the text (brackets inside strings count too);
    True sends the header to the walk, which measures exactly and names the place."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_OPENER.sub("", text)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace("[]", "").replace("{}", "")
    return bool(brackets)


# What Python's JSON reader accepts and Triton's (RapidJSON) refuses, with HTTP 500 that would count
# against a healthy server: a high surrogate escape without its low one, and numbers beyond a double.
# An escape counts only after an even run of backslashes ("\\ud800" is text, not an escape).
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u([dD][89a-fA-F][0-9a-fA-F]{2})")
# A cheap over-estimate of fractions that may not fit a double: an exponent of 3+ digits, or 309+ digits.
_MAY_OVERFLOW = re.compile(r"[eE][+]?0*[1-9][0-9]{2}|[0-9]{309}")


class _Overflow(ValueError):
    pass


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Overflow(text)
    return value


# Small headers: numbers beyond a double are found as they are read (no scan of the text first).
_loads_small = json.JSONDecoder(
    object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant, parse_float=_finite
).decode


# Digit runs this long may be integers beyond 64 bits, which orjson reads as floats (`json` as ints).
# Found as a run of zeros once every digit is a zero: two C calls, where a regex takes 6x as long.
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19


def _loads_fast(raw: bytes, text: str) -> dict[str, Any] | None:
    """The header as the exact reader would read it, by orjson; None when orjson might read it
    differently or not at all (the exact reader then reads it, or names what is wrong).

    orjson keeps the last of duplicate keys where the exact reader refuses them. A duplicate pair
    dropped from the parsed value takes at least its own colon with it, so the value re-serialised
    has fewer colons than the text; without duplicates the counts are equal, since every colon is a
    key's or inside a string and both survive. A `\\u` escape could spell a colon inside a string,
    so text with escapes goes to the exact reader.
    """
    if "\\u" in text or _LONG_DIGIT_RUN in raw.translate(_DIGITS_AS_ZEROS):
        return None
    try:
        header = orjson.loads(raw)
        # orjson reads 1024 levels and writes 254: deeper headers go to the exact reader's refusal.
        if not isinstance(header, dict) or orjson.dumps(header).count(b":") != text.count(":"):
            return None
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return None
    return header


def canonical_json(value: Any, sort_keys: bool = False) -> bytes:
    """Compact JSON of a parsed header (orjson; integers beyond 64 bits, which only the exact reader
    yields, by `json`)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except orjson.JSONEncodeError:
        # ASCII escapes: orjson refuses what may be in it, a lone surrogate escape Triton passes on.
        return json.dumps(value, sort_keys=sort_keys, separators=(",", ":")).encode()


def _overflow(exc: _Overflow) -> BadRequest:
    return BadRequest(
        f"the request JSON has the number {str(exc)[:40]}, beyond a 64-bit float; Triton refuses it"
    )


# Integers are left to the field checks (a `timeout` above 2^64-1 is refused by name) and, in
# tensor data, to Triton, whose parse error comes back as the client's 400 (gateway/fronts/http_front.py).
_numbers_only = json.JSONDecoder(parse_float=_finite, parse_constant=_refuse_constant).decode


def check_triton_json(text: str, numbers: bool = True) -> None:
    """BadRequest for JSON Triton refuses but Python reads: a lone high surrogate escape, or (with
    `numbers`) a number beyond a double (Python reads 1e999 as inf and would forward it as "Infinity")."""
    if "\\u" in text:
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
            _numbers_only(text)
        except _Overflow as exc:
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
        if fast is not None and not _may_nest_deeper_than(text, MAX_DEPTH):
            _validate(fast, max_tensors)
            return InferBody(body, header_length, text, fast, None)
        try:
            header = _loads_small(text)
        except _Overflow as exc:
            raise _overflow(exc) from None
        except (ValueError, RecursionError):
            check_triton_json(text)  # the walk below names what else is wrong
        else:
            if isinstance(header, dict) and not _may_nest_deeper_than(text, MAX_DEPTH):
                _validate(header, max_tensors)
                return InferBody(body, header_length, text, header, None)
    walker = _Walker(text, small=len(text) < OFF_LOOP_BYTES, max_tensors=max_tensors)
    i = walker.ws(0)
    if i >= len(text):
        raise BadRequest("the request body is empty; send a JSON object with 'inputs'")
    if text[i] != "{":
        value = [] if text[i] == "[" else walker.value(i, (), _OTHER)[0]
        raise BadRequest(f"the request JSON must be an object at the top level, got {_kind(value)}")
    header, end = walker.obj(i, (), _TOP)
    end = walker.ws(end)
    if end != len(text):
        raise walker.fail("extra data after the JSON object", end)
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
    args = (body, header_length, encoding, limit, None, max_tensors, inflate_ratio)
    if size < OFF_LOOP_BYTES and encoding is None:
        return parse_infer_body(*args)
    return await asyncio.to_thread(parse_infer_body, *args)
