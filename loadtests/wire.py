"""KServe v2 request bodies for load generators: JSON tensors and Triton's binary tensor extension."""

from __future__ import annotations

import json

import numpy as np

INPUT = "features"


def json_request(row: np.ndarray) -> tuple[bytes, dict[str, str]]:
    body = {
        "inputs": [
            {"name": INPUT, "shape": list(row.shape), "datatype": "FP32", "data": row.ravel().tolist()}
        ]
    }
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def binary_request(
    row: np.ndarray, outputs: tuple[str, ...] = ("probabilities", "label")
) -> tuple[bytes, dict[str, str]]:
    """JSON header + raw FP32 bytes, outputs asked for in binary too (`Inference-Header-Content-Length`)."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": INPUT,
                    "shape": list(row.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": row.nbytes},
                }
            ],
            "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs],
        }
    ).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + np.ascontiguousarray(row, dtype=np.float32).tobytes(), headers
