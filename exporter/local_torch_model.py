"""Triton Python-backend runner for the local CPU profile of a TorchScript version: torch on model.pt.

Copied into each TorchScript version as `model.py`, beside `batching.py` (exporter/local_batching.py);
the GPU profile serves the same `model.pt` with Triton's libtorch backend. Requests batched by
Triton's dynamic batcher run as one forward pass per shape group.
"""

import json
import os
import sys

import torch


class TritonPythonModel:
    def initialize(self, args):
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        sys.path.insert(0, version_dir)
        from batching import run_grouped

        self.run_grouped = run_grouped
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(version_dir, params.get("torchscript_file", "model.pt"))
        torch.set_num_threads(int(params.get("intra_op_threads", "1")))
        self.module = torch.jit.load(path, map_location="cpu")
        self.module.eval()
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        def run(batch):
            with torch.no_grad():
                return [t.numpy() for t in self.module(*(torch.from_numpy(x) for x in batch))]

        return self.run_grouped(requests, self.input_names, self.output_names, run)
