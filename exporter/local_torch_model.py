"""Triton Python-backend runner for the local CPU profile of a TorchScript version: torch on model.pt.

Copied into each TorchScript version as `model.py`; the GPU profile serves the same `model.pt` with
Triton's libtorch backend. Requests batched by Triton's dynamic batcher run as one forward pass.
"""

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(
            args["model_repository"], args["model_version"], params.get("torchscript_file", "model.pt")
        )
        torch.set_num_threads(int(params.get("intra_op_threads", "1")))
        self.module = torch.jit.load(path, map_location="cpu")
        self.module.eval()
        self.input_name = config["input"][0]["name"]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        with torch.no_grad():
            outputs = [t.numpy() for t in self.module(torch.from_numpy(batch))]
        bounds = np.cumsum([len(a) for a in arrays])[:-1]
        per_output = [np.split(o, bounds) for o in outputs]
        responses = []
        for i, request in enumerate(requests):
            wanted = set(request.requested_output_names()) or set(self.output_names)
            tensors = [
                pb_utils.Tensor(name, np.ascontiguousarray(parts[i]))
                for name, parts in zip(self.output_names, per_output, strict=True)
                if name in wanted
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
