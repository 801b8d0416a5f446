"""Triton Python-backend model: raw inputs (BYTES) -> the model's input tensor, the ensemble's step 1.

Copied into each version of `<model>_preprocess` beside `preprocess.json` and the training
preprocessing module itself (`image_preprocess.py` or `text_preprocess.py`), so served raw inputs
go through exactly the code training used. An item that cannot be decoded fails its own request
with a message naming the item; the other requests of the batch are answered.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


def stack_padded(items):
    """Stack items, zero-padding dynamic dimensions to the largest (as training's batches are).

    The same rule as `training.datasets.stack_padded`, restated because this file runs alone in
    Triton's Python backend, where training/ (and torch) cannot be imported."""
    shape = tuple(max(x.shape[d] for x in items) for d in range(items[0].ndim))
    out = np.zeros((len(items), *shape), dtype=items[0].dtype)
    for i, x in enumerate(items):
        out[(i, *(slice(0, n) for n in x.shape))] = x
    return out


class TritonPythonModel:
    def initialize(self, args):
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        sys.path.insert(0, version_dir)
        with open(os.path.join(version_dir, "preprocess.json")) as f:
            self.params = json.load(f)
        config = json.loads(args["model_config"])
        self.input_name = config["input"][0]["name"]
        self.output_name = config["output"][0]["name"]
        if self.params["kind"] == "image":
            import image_preprocess

            size = tuple(self.params["size"])
            channels = int(self.params["channels"])
            self.convert = lambda raw: image_preprocess.decode(raw, channels, size)
        else:
            import text_preprocess

            vocab = text_preprocess.vocabulary(self.params["vocab"])
            max_length = int(self.params["max_length"])
            dtype = self.params.get("dtype", "int64")

            def convert(raw):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"text is not UTF-8: {exc}") from exc
                return text_preprocess.tokenize(text, vocab, max_length).astype(dtype)

            self.convert = convert

    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, self.input_name).as_numpy().reshape(-1)
            try:
                items = []
                for i, value in enumerate(raw):
                    try:
                        items.append(self.convert(bytes(value)))
                    except ValueError as exc:
                        raise ValueError(f"{self.input_name}[{i}]: {exc}") from exc
                tensor = pb_utils.Tensor(self.output_name, stack_padded(items))
                responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
