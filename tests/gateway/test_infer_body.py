"""Parsing of HTTP inference bodies (gateway/fronts/infer_body.py): properties and exact error messages."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import LimitsConfig
from gateway.errors import BadRequest, RequestTooLarge, UnsupportedEncoding
from gateway.fronts.infer_body import (
    MAX_DEPTH,
    OFF_LOOP_BYTES,
    RawData,
    inflate,
    parse_header_length,
    parse_infer_body,
)

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
numbers = st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(st.none(), st.booleans(), numbers, names)
data_values = st.one_of(
    st.lists(numbers, max_size=8),
    st.lists(st.lists(numbers, min_size=2, max_size=2), max_size=4),
    st.lists(names, max_size=4),
    st.lists(st.booleans(), max_size=4),
)
params = st.dictionaries(names, scalars, max_size=3)
inputs = st.fixed_dictionaries(
    {
        "name": names,
        "shape": st.lists(st.integers(0, 64), max_size=3),
        "datatype": st.sampled_from(["FP32", "INT64", "BYTES", "BOOL"]),
        "data": data_values,
    },
    optional={"parameters": params},
)
requests = st.fixed_dictionaries(
    {"inputs": st.lists(inputs, max_size=3)},
    optional={
        "id": names,
        "outputs": st.lists(
            st.fixed_dictionaries({"name": names}, optional={"parameters": params}), max_size=2
        ),
        "parameters": st.dictionaries(
            st.sampled_from(["priority", "timeout", "binary_data_output"]), st.integers(0, 10**9)
        ),
    },
)


def _dumps(value: Any, indent: int | None, sort: bool) -> bytes:
    return json.dumps(value, indent=indent, sort_keys=sort, ensure_ascii=indent is None).encode()


def _resolve(header: Any, text: str) -> Any:
    """The header with each RawData replaced by the JSON its text spells."""
    if isinstance(header, RawData):
        return json.loads(text[header.start : header.end])
    if isinstance(header, dict):
        return {k: _resolve(v, text) for k, v in header.items()}
    if isinstance(header, list):
        return [_resolve(v, text) for v in header]
    return header


# canonical_bytes: 0 forces the walk used for large headers, None the default (small: json in C).
modes = st.sampled_from([0, None])


@settings(max_examples=300, deadline=None)
@given(requests, st.sampled_from([None, 1]), st.booleans(), modes)
def test_the_walk_reads_what_json_reads(
    request: dict[str, Any], indent: int | None, sort: bool, mode: int | None
) -> None:
    body = _dumps(request, indent, sort)
    parsed = parse_infer_body(body, None, canonical_bytes=mode)
    assert _resolve(parsed.header, parsed.text) == json.loads(body)
    assert parsed.request_id == request.get("id", "")
    assert parsed.timeout_us == request.get("parameters", {}).get("timeout")


@settings(max_examples=300, deadline=None)
@given(requests, requests, modes)
def test_equal_cache_keys_mean_equal_requests(a: dict[str, Any], b: dict[str, Any], mode: int | None) -> None:
    """Key material is injective on what Triton reads (everything but `id`)."""
    ka = parse_infer_body(_dumps(a, None, False), None, canonical_bytes=mode).key_material()
    kb = parse_infer_body(_dumps(b, None, True), None, canonical_bytes=mode).key_material()
    strip = lambda r: {k: v for k, v in r.items() if k != "id"}  # noqa: E731
    if ka == kb:
        assert json.loads(json.dumps(strip(a))) == json.loads(json.dumps(strip(b)))
    # Same request, other key order or id: one key for canonical (small) headers. Walked headers
    # key on their exact text (Triton reads that text), so only the id may differ there.
    if strip(a) == strip(b) and mode is None:
        assert ka == kb


@settings(max_examples=200, deadline=None)
@given(requests, st.data(), modes)
def test_any_change_to_a_data_array_changes_the_key(
    request: dict[str, Any], data: st.DataObject, mode: int | None
) -> None:
    filled = [n for n, inp in enumerate(request["inputs"]) if inp["data"]]
    if not filled:
        return
    n = data.draw(st.sampled_from(filled))
    changed = json.loads(json.dumps(request))
    changed["inputs"][n]["data"] = data.draw(data_values.filter(lambda v: v != request["inputs"][n]["data"]))
    before = parse_infer_body(_dumps(request, None, False), None, canonical_bytes=mode).key_material()
    assert parse_infer_body(_dumps(changed, None, False), None, canonical_bytes=mode).key_material() != before


def test_the_id_does_not_change_the_key_but_any_other_text_does() -> None:
    one = b'{"id":"a","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}'
    two = b'{"inputs":[{"data":[1.0],"datatype":"FP32","shape":[1],"name":"x"}], "id":"b"}'
    three = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.00]}]}'
    other_id = b'{"id":"other","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1.0]}]}'
    # Walked (large) headers are forwarded as received and keyed on their exact text, id blanked.
    keys = [parse_infer_body(b, None, canonical_bytes=0).key_material() for b in (one, two, three, other_id)]
    assert keys[0] == keys[3] and len({keys[0], keys[1], keys[2]}) == 3
    # Small headers are forwarded re-serialised, so equal values are one key whatever their spelling.
    keys = [parse_infer_body(b, None).key_material() for b in (one, two, three)]
    assert keys[0] == keys[1] == keys[2]


@settings(max_examples=200, deadline=None)
@given(requests, st.sampled_from(["top", "input", "param", "output"]), modes)
def test_duplicate_keys_are_refused_wherever_they_are(
    request: dict[str, Any], where: str, mode: int | None
) -> None:
    text = json.dumps(request)
    inp = '{"name":"x","shape":[1],"datatype":"FP32","data":[1],"name":"y"}'
    body = {
        "top": '{"inputs":[],' + text[1:-1] + ',"inputs":[]}' if request else '{"inputs":[],"inputs":[]}',
        "input": '{"inputs":[' + inp + "]}",
        "param": '{"inputs":[],"parameters":{"timeout":1,"timeout":2}}',
        "output": '{"inputs":[],"outputs":[{"name":"a","parameters":{"b":1,"b":2}}]}',
    }[where]
    with pytest.raises(BadRequest, match="duplicate key"):
        parse_infer_body(body.encode(), None, canonical_bytes=mode)


@pytest.mark.parametrize("mode", [0, None])
def test_duplicate_messages_name_the_key_and_place(mode: int | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_infer_body(b'{"inputs":[{"name":"a","shape":[1],"shape":[2]}]}', None, canonical_bytes=mode)
    assert info.value.message == (
        "duplicate key 'shape' in inputs[0] of the request JSON; send each key once "
        "(Triton reads the first occurrence, so the request is ambiguous)"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"inputs":[{"data":5}]}', "inputs[0].data must be a JSON array"),
        (b'{"id":5,"inputs":[]}', "id must be a string, got a number"),
        (b'{"inputs":[],"parameters":[]}', "parameters must be an object, got an array"),
        (b'{"inputs":[],"outputs":{}}', "outputs must be an array of objects, got an object"),
        (b'{"inputs":[{"name":1}]}', "inputs[0].name must be a string, got a number"),
        (
            b'{"inputs":[{"shape":[-1]}]}',
            "inputs[0].shape must be an array of non-negative integers, got [-1]",
        ),
        (b'{"inputs":[],"parameters":{"sequence_id":1.5}}', "parameters.sequence_id must be a non-negative"),
        (b'{"inputs":[]} {}', "the request JSON is malformed: extra data after the JSON object at offset 14"),
        (
            b'{"inputs":[],"x":NaN}',
            "the request JSON is malformed: invalid value for x (NaN is not valid JSON)",
        ),
        (b"\xff{}", "the request JSON is not valid UTF-8 at byte 0"),
        (b"  ", "the request body is empty; send a JSON object with 'inputs'"),
        (
            b'{"inputs":[{"data":' + b"[" * 40 + b'"a"' + b"]" * 40 + b"}]}",
            "inputs[0].data nests deeper than 32",
        ),
        (b'{"inputs":[{"data":[1,2}]}', "the request JSON is malformed"),
        (
            b'{"inputs":[{"data":' + b"[0," * 40 + b"0" + b"]" * 40 + b"}]}",
            "inputs[0].data nests deeper than 32",
        ),
    ],
)
@pytest.mark.parametrize("mode", [0, None])
def test_bad_bodies_are_400s_naming_the_field(body: bytes, message: str, mode: int | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_infer_body(body, None, canonical_bytes=mode)
    assert info.value.message.startswith(message)


def test_deep_nesting_is_refused_on_both_walks() -> None:
    deep = b'{"inputs":[],"parameters":{"x":' + b"[" * 5000 + b"]" * 5000 + b"}}"
    with pytest.raises(BadRequest, match="nests too deeply at parameters.x"):
        parse_infer_body(deep, None)
    padded = deep[:-2] + b',"pad":"' + b"x" * OFF_LOOP_BYTES + b'"}}'  # the large-body walk
    with pytest.raises(BadRequest, match=f"nests deeper than {MAX_DEPTH} levels"):
        parse_infer_body(padded, None)


def test_sequence_id_is_exposed_for_sticky_routing() -> None:
    def seq(p: str) -> Any:
        return parse_infer_body(('{"inputs":[],"parameters":{' + p + "}}").encode(), None)

    assert seq('"sequence_id":7').sequence_id == 7 and seq('"sequence_id":7').sticky
    assert seq('"sequence_id":"s-1"').sticky
    assert not seq('"sequence_id":0').sticky and not seq('"sequence_id":""').sticky
    assert not seq('"priority":1').sticky


@settings(max_examples=200, deadline=None)
@given(requests, st.floats(1e-6, 100.0), st.booleans(), modes)
def test_the_remaining_deadline_is_spliced_in_without_touching_the_rest(
    request: dict[str, Any], timeout_s: float, binary: bool, mode: int | None
) -> None:
    header = _dumps(request, None, False)
    tail = b"\x00\x01tensor-bytes" if binary else b""
    parsed = parse_infer_body(header + tail, len(header) if binary else None, canonical_bytes=mode)
    body, n = parsed.with_timeout(timeout_s)
    if binary:
        assert n is not None and body[n:] == tail
        body = body[:n]
    got = json.loads(body)
    ours = max(1, int(timeout_s * 1e6))
    client = request.get("parameters", {}).get("timeout")
    want = dict(request)
    want["parameters"] = {
        **request.get("parameters", {}),
        "timeout": client if client and client <= ours else ours,
    }
    assert got == json.loads(json.dumps(want))


def test_splicing_counts_bytes_not_characters() -> None:
    body = '{"inputs":[{"name":"ü€𝄞","shape":[1],"datatype":"BYTES","data":["ü"]}],"parameters":{}}'.encode()
    parsed = parse_infer_body(body, None, canonical_bytes=0)
    assert json.loads(parsed.with_timeout(0.25)[0])["parameters"] == {"timeout": 250000}
    empty = parse_infer_body(b"{}", None, canonical_bytes=0)
    assert json.loads(empty.with_timeout(1)[0]) == {"parameters": {"timeout": 1000000}}


@pytest.mark.parametrize("mode", [0, None])
def test_a_smaller_client_timeout_is_kept_and_zero_means_none(mode: int | None) -> None:
    smaller = parse_infer_body(b'{"inputs":[],"parameters":{"timeout":5}}', None, canonical_bytes=mode)
    assert json.loads(smaller.with_timeout(1.0)[0]) == {"inputs": [], "parameters": {"timeout": 5}}
    zero = parse_infer_body(b'{"inputs":[],"parameters":{"timeout":0}}', None, canonical_bytes=mode)
    assert json.loads(zero.with_timeout(1.0)[0])["parameters"]["timeout"] == 1_000_000


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "GZIP ", "identity"])
def test_inflate_round_trips_within_the_bound(encoding: str) -> None:
    raw = b'{"inputs":[]}' * 100
    packed = {"gzip": gzip.compress, "deflate": zlib.compress}.get(encoding.strip().lower(), bytes)(raw)
    assert inflate(packed, encoding, len(raw)) == raw


def test_inflate_bounds_and_refusals() -> None:
    bomb = gzip.compress(b" " * 1_000_000)
    with pytest.raises(RequestTooLarge, match="inflates to more than the limit of 1000 bytes"):
        inflate(bomb, "gzip", 1000)
    with pytest.raises(UnsupportedEncoding, match="Content-Encoding 'br' is not supported"):
        inflate(b"", "br", 10)
    with pytest.raises(BadRequest, match="not valid gzip data"):
        inflate(b"plain", "gzip", 10)
    with pytest.raises(BadRequest, match="7 bytes after the compressed stream"):
        inflate(zlib.compress(b"{}") + b"trailer", "deflate", 10)
    body = parse_infer_body(gzip.compress(b'{"inputs":[]}'), None, "gzip", 100)
    assert body.body == b'{"inputs":[]}'  # the inflated bytes are what is forwarded


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (b"0", 0), (b"12", 12), (b" 12 ", 12)],
)
def test_header_length_accepts_decimal(value: bytes | None, expected: int | None) -> None:
    assert parse_header_length(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"ten", "Inference-Header-Content-Length must be an integer, got 'ten'"),
        (b"+5", "Inference-Header-Content-Length must be an integer, got '+5'"),
        (b"1_0", "Inference-Header-Content-Length must be an integer, got '1_0'"),
        (b"-5", "Inference-Header-Content-Length must not be negative, got '-5'"),
    ],
)
def test_header_length_refuses_the_rest(value: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_header_length(value)
    assert info.value.message == message


def test_header_length_past_the_body() -> None:
    with pytest.raises(BadRequest, match="Inference-Header-Content-Length 9 exceeds the body size 2"):
        parse_infer_body(b"{}", 9)


def test_body_read_timeout_is_configurable_and_positive() -> None:
    assert LimitsConfig().body_read_timeout_s == 30.0
    assert LimitsConfig(body_read_timeout_s=2.5).body_read_timeout_s == 2.5
    with pytest.raises(ValueError, match="body_read_timeout_s"):
        LimitsConfig(body_read_timeout_s=0)


def test_the_body_buffer_must_hold_one_request_of_the_largest_size() -> None:
    # Defaults fit the deployment's 1 GiB pod limit: 128 MiB of bodies held, two of the largest.
    defaults = LimitsConfig()
    assert defaults.max_buffered_body_bytes == 128 * 1024 * 1024
    assert defaults.max_buffered_body_bytes >= 2 * defaults.max_request_bytes
    with pytest.raises(ValueError, match=r"limits.max_buffered_body_bytes \(10\) must be at least"):
        LimitsConfig(max_request_bytes=100, max_buffered_body_bytes=10)


# The fast reader (orjson) must read exactly what the exact reader (`json` with hooks) reads, or step
# aside: texts with duplicate keys whose values are full of colons, escapes, integers past 64 bits.
colon_names = st.text(st.sampled_from(':"\\ab,{}[]é'), max_size=5)


def _duplicated(first: str, second: str, third: str) -> str:
    """A text whose key `first` comes twice, values full of colons and quotes around it."""
    a, b, c = json.dumps(first), json.dumps(second), json.dumps(third)
    return f'{{"inputs":[],{a}:{b},{a}:1,{c}:[{b}]}}'


texts = st.one_of(
    requests.map(lambda r: json.dumps(r, ensure_ascii=False)),
    requests.map(lambda r: json.dumps(r, ensure_ascii=True, indent=1)),
    st.tuples(colon_names, colon_names, colon_names).map(lambda t: _duplicated(*t)),
    st.integers(-(2**70), 2**70).map(lambda n: f'{{"inputs":[],"parameters":{{"timeout":{n}}}}}'),
    st.floats(allow_nan=False).map(lambda f: f'{{"inputs":[{{"data":[{f!r}]}}]}}'),
)


@settings(max_examples=500, deadline=None)
@given(texts)
def test_the_fast_reader_reads_what_the_exact_reader_reads_or_steps_aside(text: str) -> None:
    from gateway.fronts.exact_json import loads_small
    from gateway.fronts.infer_body import _loads_fast

    fast = _loads_fast(text.encode(), text)
    try:
        exact = loads_small(text)
    except ValueError:
        assert fast is None, "the exact reader refuses this text: the fast one must step aside"
        return
    if fast is not None:
        assert fast == exact
        assert json.dumps(fast) == json.dumps(exact), "same types too (an int is not a float)"


@pytest.mark.parametrize(
    "text",
    [
        '{"a":"x","a":"::"}',  # the kept value has more colons than the dropped one
        '{"inputs":[],"a":{"b":1,"b":{"c:":":"}}}',
        '{"inputs":[],"\\u003a":1,"\\u003a":2}',  # an escaped colon
        '{"inputs":[],"parameters":{"timeout":18446744073709551616}}',  # past uint64: orjson reads a float
        '{"inputs":[{"data":[1,-9223372036854775809]}]}',  # below int64: a float to orjson too
        '{"inputs":[{"data":[[[-9223372036854775809]]]}]}',
        '{"inputs":[],"p":{"q":-9223372036854775809}}',
        '{"inputs":[],"p":' + "[" * 32 + "]" * 32 + "}",  # 33 levels: the walk decides, and names where
    ],
)
def test_texts_the_fast_reader_must_not_take(text: str) -> None:
    from gateway.fronts.infer_body import _loads_fast

    assert _loads_fast(text.encode(), text) is None


@pytest.mark.parametrize(
    "text",
    [
        '{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32","data":[0.5,-1e18,9223372036854775807]}]}',
        '{"id":"a:b","inputs":[],"parameters":{"k:":"v::"},"outputs":[{"name":"y"}]}',
        '{"inputs":[],"p":' + "[" * 31 + "]" * 31 + "}",  # 32 levels, the most the fast reader takes
    ],
)
def test_plain_requests_are_read_by_the_fast_reader(text: str) -> None:
    """Every request that is not one of the cases above takes the fast path (a slower reader would
    pass every other test)."""
    from gateway.fronts.exact_json import loads_small
    from gateway.fronts.infer_body import _loads_fast

    assert _loads_fast(text.encode(), text) == loads_small(text)


@pytest.mark.parametrize("levels", [33, 253, 254, 300, 1023, 1024])
@pytest.mark.parametrize("where", ["parameters", "data", "top"])
def test_nesting_past_the_limit_is_a_400_at_every_depth(levels: int, where: str) -> None:
    """orjson reads 1024 levels and writes 254 (a depth between once escaped as a 500)."""
    nested = "[" * levels + "]" * levels
    body = {
        "parameters": '{"inputs":[],"parameters":{"p":%s}}',
        "data": '{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":%s}]}',
        "top": '{"inputs":[],"extra":%s}',
    }[where].replace("%s", nested)
    with pytest.raises(BadRequest, match="nests (deeper than 32 levels|too deeply)"):
        parse_infer_body(body.encode(), None)


def test_a_lone_low_surrogate_escape_is_keyed_and_forwarded() -> None:
    """Triton passes a lone low surrogate on; orjson cannot write one, the exact writer escapes it."""
    parsed = parse_infer_body(b'{"inputs":[],"x":"\\udc00","parameters":{"a":1}}', None)
    assert b'"\\udc00"' in parsed.key_material()[0]
    assert b'"\\udc00"' in parsed.with_timeout(1.0, canonical=True)[0]
    assert b'"timeout":1000000' in parsed.with_timeout(1.0)[0]


@pytest.mark.parametrize(
    ("text", "unpaired"),
    [
        ('"\\ud800"', "ud800"),
        ('"\\udc00\\ud800"', "ud800"),  # a lone low one, then a high one without its low one
        ('"\\ud800\\\\ud800"', "ud800"),  # the second is text (an escaped backslash), not an escape
        ('"\\ud800\\udc00\\udbff"', "udbff"),
    ],
)
def test_an_unpaired_high_surrogate_escape_is_refused_wherever_it_stands(text: str, unpaired: str) -> None:
    with pytest.raises(BadRequest, match=f"unpaired surrogate escape \\\\{unpaired}"):
        parse_infer_body(('{"inputs":[],"x":' + text + "}").encode(), None)


@pytest.mark.parametrize("text", ['"\\udc00"', '"\\ud800\\udc00"', '"\\udc00\\udc00"', '"\\\\ud800"'])
def test_paired_and_lone_low_surrogate_escapes_pass(text: str) -> None:
    parse_infer_body(('{"inputs":[],"x":' + text + "}").encode(), None)
