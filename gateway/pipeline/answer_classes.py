"""The class output of an inference answer, row by row, read from Triton's HTTP answer (JSON data or
binary output) or gRPC answer: the matrix itself (a cascade's rule reads the probabilities) or each
row's argmax (shadow traffic). None when the answer holds no such output in a form read here; shadow
traffic then skips the request, and a cascade escalates it, rather than guessing."""

from __future__ import annotations

import json
from typing import Any, Final

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

_DTYPES: Final = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
}


def _matrix(values: np.ndarray[Any, Any], shape: list[int]) -> np.ndarray[Any, Any] | None:
    """One row per batch item (a shape without a batch axis is one row)."""
    if not shape or int(np.prod(shape)) != values.size or values.size == 0:
        return None
    return values.reshape(-1, shape[-1]) if len(shape) > 1 else values.reshape(1, -1)


def _classes(matrix: np.ndarray[Any, Any] | None) -> list[str] | None:
    return None if matrix is None else [str(int(i)) for i in matrix.argmax(axis=1)]


def _pick(outputs: list[Any], name: str, key: Any, exact: bool = False) -> int | None:
    """Index of the output called `name`, else (unless `exact`) of the only output."""
    names = [key(o) for o in outputs]
    if name in names:
        return names.index(name)
    return 0 if len(outputs) == 1 and not exact else None


def http_classes(body: bytes, header_length: bytes | None, output: str) -> list[str] | None:
    return _classes(http_output(body, header_length, output))


def grpc_classes(raw: bytes, output: str) -> list[str] | None:
    return _classes(grpc_output(raw, output))


def http_output(
    body: bytes, header_length: bytes | None, output: str, exact: bool = False
) -> np.ndarray[Any, Any] | None:
    """The output `output` (else, unless `exact`, the only one) of an HTTP answer, one row per item.
    A cascade's rule reads exactly its output: `logits` judged as probabilities would keep answers
    the rule escalates."""
    try:
        split = int(header_length) if header_length is not None else len(body)
        head = json.loads(body[:split])
        outputs = head["outputs"]
        i = _pick(outputs, output, lambda o: o.get("name"), exact)
        if i is None:
            return None
        chosen = outputs[i]
        dtype = _DTYPES.get(chosen.get("datatype", ""))
        if dtype is None:
            return None
        shape = [int(d) for d in chosen["shape"]]
        if "data" in chosen:
            return _matrix(np.asarray(chosen["data"], dtype=dtype).ravel(), shape)
        offset = split
        for o in outputs[:i]:  # binary outputs follow the JSON header in order
            offset += int(o.get("parameters", {}).get("binary_data_size", 0))
        size = int(chosen["parameters"]["binary_data_size"])
        return _matrix(np.frombuffer(body[offset : offset + size], dtype=dtype), shape)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


def grpc_output(raw: bytes, output: str, exact: bool = False) -> np.ndarray[Any, Any] | None:
    """The output `output` (else, unless `exact`, the only one) of a serialized ModelInferResponse,
    one row per item."""
    try:
        answer = pb.ModelInferResponse.FromString(raw)
    except DecodeError:
        return None
    outputs = list(answer.outputs)
    i = _pick(outputs, output, lambda o: o.name, exact)
    if i is None:
        return None
    chosen = outputs[i]
    dtype = _DTYPES.get(chosen.datatype)
    if dtype is None:
        return None
    shape = list(chosen.shape)
    try:
        if i < len(answer.raw_output_contents):
            return _matrix(np.frombuffer(answer.raw_output_contents[i], dtype=dtype), shape)
        contents = chosen.contents
        values = (
            contents.fp32_contents
            or contents.fp64_contents
            or contents.int_contents
            or contents.int64_contents
        )
        return _matrix(np.asarray(values, dtype=dtype), shape)
    except ValueError:
        return None
