"""Tiny Python-backend models (OUTPUT0 = INPUT0 * scale + 1): fixtures of tests and the placement
benchmark's many models, where what a model computes does not matter but loading it does."""

from __future__ import annotations

from pathlib import Path

AFFINE_MODEL_PY = """
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = cfg.get("parameters", {})
        self.scale = float(params.get("scale", {}).get("string_value", "2.0"))
        self.fail = params.get("fail_reason", {}).get("string_value", "")
        self.sleep_s = float(params.get("sleep_s", {}).get("string_value", "0"))
        if self.fail:
            raise pb_utils.TritonModelException(self.fail)

    def execute(self, requests):
        responses = []
        if self.sleep_s:
            time.sleep(self.sleep_s)
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = (x * self.scale + 1.0).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters [ {{ key: "scale" value: {{ string_value: "{scale}" }} }} {extra} ]
"""


def write_affine_model(
    repo: Path,
    name: str = "affine",
    scale: float = 2.0,
    fail_reason: str = "",
    version: int = 1,
    sleep_s: float = 0.0,
) -> Path:
    """Write a model computing OUTPUT0 = INPUT0 * scale + 1 with both config profiles."""
    model_dir = repo / name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    (model_dir / str(version) / "model.py").write_text(AFFINE_MODEL_PY)
    extra = f', {{ key: "fail_reason" value: {{ string_value: "{fail_reason}" }} }}' if fail_reason else ""
    if sleep_s:  # each batch of requests takes this long: requests stay in flight
        extra += f', {{ key: "sleep_s" value: {{ string_value: "{sleep_s}" }} }}'
    text = CONFIG.format(name=name, scale=scale, extra=extra)
    (model_dir / "config.pbtxt").write_text(text)
    (model_dir / "configs").mkdir(exist_ok=True)
    (model_dir / "configs" / "local.pbtxt").write_text(text)
    return model_dir
