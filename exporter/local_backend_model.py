"""Triton Python-backend runner for the local CPU profile: ONNX Runtime on the version's model.onnx.

Copied into each published version as `model.py`, beside `batching.py` (exporter/local_batching.py):
requests are run in shape groups, so local serving batches like the GPU profile does.
"""

import json
import os
import sys

import onnxruntime as ort


class TritonPythonModel:
    def initialize(self, args):
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        sys.path.insert(0, version_dir)
        from batching import run_grouped

        self.run_grouped = run_grouped
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(version_dir, params.get("onnx_file", "model.onnx"))
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(params.get("intra_op_threads", "1"))
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        def run(batch):
            return self.session.run(self.output_names, dict(zip(self.input_names, batch, strict=True)))

        return self.run_grouped(requests, self.input_names, self.output_names, run)
