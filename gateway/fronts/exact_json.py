"""The exact reader of a request's JSON: Python's `json` with hooks, and a walk over large headers.

What it reads is what Triton's parser (RapidJSON) reads, or it refuses the text and names what is
wrong; gateway/fronts/infer_body.py asks it whenever orjson might read a header differently.

- Duplicate object keys are refused at every level: Triton takes the first occurrence, Python's
  `json` the last.
- Numbers beyond a double are refused as they are read (`finite`): Python reads 1e999 as inf.
- The walk (`Walker`) is a small recursive descent over the header in which every container element
  passes through Python code, so a large body walked in a worker thread gives the event loop the GIL
  back at the interpreter's switch interval (a single C-level `json.loads` of 9 MB holds it for
  ~1 s). That is why this module is never compiled (gateway/compiled_build.py): compiled code does
  not give the GIL back.
"""

from __future__ import annotations

import json
import json.decoder
import math
import re
from typing import Any

from gateway.errors import BadRequest
from gateway.fronts.json_depth import MAX_DEPTH, brackets_deeper_than, may_nest_deeper_than

_WS = re.compile(r"[ \t\n\r]*")
# A data array made only of numbers, literals and nested arrays: the common case, skipped in one scan.
_PLAIN_ARRAY = re.compile(r"\[[-+.,0-9 \t\n\reEtrufalsn\[\]]*")
# Tokens that matter for bracket depth once strings appear: a whole string, or a bracket.
_ARRAY_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]]', re.S)
_scanstring: Any = json.decoder.scanstring  # type: ignore[attr-defined]  # C scanner, untyped


def refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Scalars only (strings, numbers, literals): containers are walked by `Walker`.
_scan_scalar: Any = json.JSONDecoder(parse_constant=refuse_constant).scan_once  # type: ignore[attr-defined]


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


def refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
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
    object_pairs_hook=refuse_duplicates, parse_constant=refuse_constant
).scan_once


def too_many(where: str, what: str, limit: int) -> BadRequest:
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


def kind(value: Any) -> str:
    """A JSON value's kind as an error names it ("an object", "a string", ...)."""
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


class Walker:
    """Recursive descent over the JSON header text; positions are character offsets into it.

    `small` bodies scan uninteresting containers in one C call; large ones walk every container
    in Python so a worker thread running the walk yields the GIL to the event loop.
    """

    def __init__(self, text: str, small: bool, max_tensors: int) -> None:
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
                if not may_nest_deeper_than(s[i:end], MAX_DEPTH - len(path)):
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
                raise too_many(_where(path), "entries", self.max_tensors)
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
                raise too_many("the request", str(path[0]), self.max_tensors)
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
            if opened > 1 and brackets_deeper_than(s[i:end], MAX_DEPTH):
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


class Overflow(ValueError):
    """A number beyond a double, which Triton refuses (Python reads 1e999 as inf)."""


def finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise Overflow(text)
    return value


# Small headers: numbers beyond a double are found as they are read (no scan of the text first).
loads_small = json.JSONDecoder(
    object_pairs_hook=refuse_duplicates, parse_constant=refuse_constant, parse_float=finite
).decode

# Integers are left to the field checks (a `timeout` above 2^64-1 is refused by name) and, in
# tensor data, to Triton, whose parse error comes back as the client's 400 (gateway/fronts/http_front.py).
numbers_only = json.JSONDecoder(parse_float=finite, parse_constant=refuse_constant).decode


def walk(text: str, small: bool, max_tensors: int) -> tuple[dict[str, Any], Walker]:
    """The header as Triton reads it, and the walker that found where its parts sit (for keying
    and splicing); BadRequest names what is wrong. `small`: scan uninteresting containers in C."""
    walker = Walker(text, small=small, max_tensors=max_tensors)
    i = walker.ws(0)
    if i >= len(text):
        raise BadRequest("the request body is empty; send a JSON object with 'inputs'")
    if text[i] != "{":
        value = [] if text[i] == "[" else walker.value(i, (), _OTHER)[0]
        raise BadRequest(f"the request JSON must be an object at the top level, got {kind(value)}")
    header, end = walker.obj(i, (), _TOP)
    end = walker.ws(end)
    if end != len(text):
        raise walker.fail("extra data after the JSON object", end)
    return header, walker
