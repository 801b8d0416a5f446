"""A gRPC ModelInferRequest read straight from its wire bytes, when it has the plain shape: what the
conversion to Triton's HTTP port (grpc_over_http.py) needs of it, at a fraction of protobuf's cost.

Reading a parsed message's fields through protobuf's Python API is a lookup by name in C per field
and a new wrapper object per tensor (about 800 instructions each): the conversion of one small
request cost 55,000 instructions, a fifth of a gRPC call's in the worker. The plain shape is what
gRPC clients send: the model's name, version and id, inputs with a name, datatype and packed shape,
outputs with a name, and raw input contents, each field once. Anything else (request, tensor or
output parameters, typed contents, an unpacked shape, a field repeated where protobuf would keep
the last, text that is not UTF-8, an unknown field, a truncated or malformed message) is None here,
and protobuf reads the message as before: this reader never decides what protobuf would decide
otherwise (tests/gateway/test_grpc_over_http.py compares both on mutated messages).
"""

from __future__ import annotations

from typing import Final

# Field keys (field number << 3 | wire type 2, length-delimited) of ModelInferRequest ...
_MODEL_NAME: Final = 0x0A
_MODEL_VERSION: Final = 0x12
_ID: Final = 0x1A
_INPUTS: Final = 0x2A
_OUTPUTS: Final = 0x32
_RAW_INPUT_CONTENTS: Final = 0x3A
# ... and of its InferInputTensor (name, datatype, packed shape) and InferRequestedOutputTensor (name)
_TENSOR_NAME: Final = 0x0A
_TENSOR_DATATYPE: Final = 0x12
_TENSOR_SHAPE: Final = 0x1A
_INT64_RANGE: Final = 2**63
_UINT64_RANGE: Final = 2**64


class PlainInput:
    __slots__ = ("name", "datatype", "shape")

    def __init__(self, name: str, datatype: str, shape: list[int]) -> None:
        self.name = name
        self.datatype = datatype
        self.shape = shape


class PlainRequest:
    __slots__ = ("model_name", "model_version", "id", "inputs", "outputs", "raw_input_contents")

    def __init__(
        self,
        model_name: str,
        model_version: str,
        request_id: str,
        inputs: list[PlainInput],
        outputs: list[str],
        raw_input_contents: list[bytes],
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.id = request_id
        self.inputs = inputs
        self.outputs = outputs  # the requested outputs' names
        self.raw_input_contents = raw_input_contents


def read_plain(message: bytes) -> PlainRequest | None:
    """The request as protobuf would read it, or None when it is not of the plain shape."""
    texts = ["", "", ""]  # model_name, model_version, id
    seen = [False, False, False]
    inputs: list[PlainInput] = []
    outputs: list[str] = []
    raw: list[bytes] = []
    end = len(message)
    pos = 0
    while pos < end:
        key = message[pos]
        length, start = _varint(message, pos + 1, end)
        if length < 0 or start + length > end:
            return None
        stop = start + length
        if key == _MODEL_NAME or key == _MODEL_VERSION or key == _ID:
            field = (key >> 3) - 1
            text = _text(message, start, stop)
            if text is None or seen[field]:
                return None  # protobuf keeps the last of a repeated field: not the plain shape
            seen[field] = True
            texts[field] = text
        elif key == _INPUTS:
            tensor = _read_input(message, start, stop)
            if tensor is None:
                return None
            inputs.append(tensor)
        elif key == _OUTPUTS:
            name = _read_output(message, start, stop)
            if name is None:
                return None
            outputs.append(name)
        elif key == _RAW_INPUT_CONTENTS:
            raw.append(message[start:stop])
        else:
            return None  # parameters, another wire type, or a field this reader does not know
        pos = stop
    return PlainRequest(texts[0], texts[1], texts[2], inputs, outputs, raw)


def _read_input(data: bytes, pos: int, end: int) -> PlainInput | None:
    texts = ["", ""]  # name, datatype
    seen = [False, False]
    shape: list[int] | None = None
    while pos < end:
        key = data[pos]
        length, start = _varint(data, pos + 1, end)
        if length < 0 or start + length > end:
            return None
        stop = start + length
        if key == _TENSOR_NAME or key == _TENSOR_DATATYPE:
            field = (key >> 3) - 1
            text = _text(data, start, stop)
            if text is None or seen[field]:
                return None
            seen[field] = True
            texts[field] = text
        elif key == _TENSOR_SHAPE and shape is None:
            shape = _packed_int64(data, start, stop)
            if shape is None:
                return None
        else:
            return None  # parameters, contents, an unpacked or second shape, an unknown field
        pos = stop
    return PlainInput(texts[0], texts[1], shape if shape is not None else [])


def _read_output(data: bytes, pos: int, end: int) -> str | None:
    name: str | None = None
    while pos < end:
        key = data[pos]
        length, start = _varint(data, pos + 1, end)
        if length < 0 or start + length > end or key != _TENSOR_NAME or name is not None:
            return None  # parameters (a classification count), a repeated name, an unknown field
        name = _text(data, start, start + length)
        if name is None:
            return None
        pos = start + length
    return name if name is not None else ""


def _packed_int64(data: bytes, pos: int, end: int) -> list[int] | None:
    values = []
    while pos < end:
        value, pos = _varint(data, pos, end)
        if value < 0:
            return None
        values.append(value - _UINT64_RANGE if value >= _INT64_RANGE else value)
    return values


def _text(data: bytes, start: int, stop: int) -> str | None:
    try:
        return data[start:stop].decode()
    except UnicodeDecodeError:
        return None


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, the position after it); value -1 when it runs past `end` or beyond 64 bits."""
    value = 0
    shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value, pos) if value < _UINT64_RANGE else (-1, pos)
        shift += 7
        if shift > 63:
            return -1, pos
    return -1, pos
