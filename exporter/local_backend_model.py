"""Triton Python-backend runner for the local CPU profile: ONNX Runtime on the version's model.onnx.

Copied into each published version as `model.py`. Triton's dynamic batcher hands `execute` several
requests at once; they are concatenated into one ONNX Runtime run and split back, so local serving
batches like the GPU profile does.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(
            args["model_repository"], args["model_version"], params.get("onnx_file", "model.onnx")
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(params.get("intra_op_threads", "1"))
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.input_name = config["input"][0]["name"]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        batch = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        outputs = self.session.run(self.output_names, {self.input_name: batch})
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
