"""KServe v2 request bodies for load generators: JSON tensors and Triton's binary tensor extension."""

from __future__ import annotations

import json
import struct

import numpy as np

INPUT = "features"
Tensors = tuple[tuple[str, str, np.ndarray], ...]  # (name, Triton datatype, batched array)


def _tensors(row: np.ndarray | Tensors) -> Tensors:
    if isinstance(row, np.ndarray):  # the table contract: one FP32 `features`
        return ((INPUT, "FP32", row),)
    return row


def _json_data(datatype: str, x: np.ndarray) -> list:
    if datatype == "BYTES":
        try:
            return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in x.ravel()]
        except UnicodeDecodeError as exc:
            raise ValueError(
                "binary BYTES (encoded images) cannot travel as JSON: use --protocol http-binary or grpc"
            ) from exc
    return x.ravel().tolist()


def json_request(row: np.ndarray | Tensors) -> tuple[bytes, dict[str, str]]:
    body = {
        "inputs": [
            {"name": n, "shape": list(x.shape), "datatype": d, "data": _json_data(d, x)}
            for n, d, x in _tensors(row)
        ]
    }
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def tensor_bytes(datatype: str, x: np.ndarray) -> bytes:
    """The binary tensor extension's bytes: raw little-endian values; BYTES items length-prefixed."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in (bytes(v) for v in x.ravel()))
    return np.ascontiguousarray(x).tobytes()


def binary_request(
    row: np.ndarray | Tensors, outputs: tuple[str, ...] = ("probabilities", "label")
) -> tuple[bytes, dict[str, str]]:
    """JSON header + raw tensor bytes, outputs asked for in binary too (`Inference-Header-Content-Length`)."""
    tensors = _tensors(row)
    payloads = [tensor_bytes(d, x) for _, d, x in tensors]
    header = json.dumps(
        {
            "inputs": [
                {"name": n, "shape": list(x.shape), "datatype": d, "parameters": {"binary_data_size": len(b)}}
                for (n, d, x), b in zip(tensors, payloads, strict=True)
            ],
            "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs],
        }
    ).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + b"".join(payloads), headers
