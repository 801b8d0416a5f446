"""What translating gRPC to Triton's HTTP binary protocol would cost the gateway per call.

One of the gRPC upstream alternatives of the pipeline issue: the bridge could call Triton's HTTP
port (binary tensor extension) instead of its gRPC port through HAProxy's relay, if it translated
each ModelInferRequest into an HTTP binary request and each answer back. This times the least that
translation does (inputs as raw bytes, outputs as binary, no parameters, no typed `contents`, no
error mapping) for `make bench-gateway`'s request, in this process. Usage:
  python benchmarks/grpc_translation_bench.py
"""

from __future__ import annotations

import json
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from benchmarks.gateway_bench import grpc_request  # noqa: E402

CLASSES = 4


def to_http(raw: bytes) -> tuple[bytes, int]:
    """ModelInferRequest bytes -> (HTTP binary body, JSON header length)."""
    req = pb.ModelInferRequest.FromString(raw)
    inputs = [
        {
            "name": t.name,
            "datatype": t.datatype,
            "shape": list(t.shape),
            "parameters": {"binary_data_size": len(req.raw_input_contents[i])},
        }
        for i, t in enumerate(req.inputs)
    ]
    header: dict[str, object] = {"inputs": inputs}
    if req.outputs:
        header["outputs"] = [{"name": o.name, "parameters": {"binary_data": True}} for o in req.outputs]
    if req.id:
        header["id"] = req.id
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b"".join(req.raw_input_contents), len(head)


def to_grpc(body: bytes, header_length: int) -> bytes:
    """Triton's HTTP binary answer -> ModelInferResponse bytes."""
    header = json.loads(body[:header_length])
    resp = pb.ModelInferResponse(
        model_name=header["model_name"], model_version=header["model_version"], id=header.get("id", "")
    )
    at = header_length
    for output in header["outputs"]:
        resp.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        size = output["parameters"]["binary_data_size"]
        resp.raw_output_contents.append(body[at : at + size])
        at += size
    return resp.SerializeToString()


def main() -> None:
    request = grpc_request("bench")
    out = np.random.default_rng(0).random((1, CLASSES)).astype(np.float32).tobytes()
    head = json.dumps(
        {
            "model_name": "bench",
            "model_version": "1",
            "outputs": [
                {
                    "name": "probabilities",
                    "datatype": "FP32",
                    "shape": [1, CLASSES],
                    "parameters": {"binary_data_size": len(out)},
                }
            ],
        }
    ).encode()
    n = 20000
    forward = timeit.timeit(lambda: to_http(request), number=n) / n * 1e6
    back = timeit.timeit(lambda: to_grpc(head + out, len(head)), number=n) / n * 1e6
    print("| translation | µs per call |\n|---|---:|")
    print(f"| ModelInferRequest -> HTTP binary request | {forward:.1f} |")
    print(f"| HTTP binary answer -> ModelInferResponse | {back:.1f} |")
    print(f"| both | {forward + back:.1f} |")


if __name__ == "__main__":
    main()
