"""Raw inputs served by Triton: an ensemble that turns PNG/JPEG bytes or UTF-8 text into tensors.

For a model whose training data had image or text preprocessing, export also publishes, at the
same version number:
- `<name>_preprocess`: a Python-backend model, input `raw` (BYTES, one item per row), output the
  model's input tensor, running the training preprocessing module itself;
- `<name>_raw`: an ensemble (`platform: "ensemble"`) of version v of the preprocess model and
  version v of the model, so one request of raw bytes gets the model's logits, probabilities and
  label. Clients may call `<name>` with tensors or `<name>_raw` with bytes; the gateway routes and
  caches both like any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from exporter.contract import ServingContract
from exporter.triton_config import DTYPES, ConfigOptions
from repository.disk import new_staging_dir
from repository.layout import CARD, Published
from repository.model_config import LOCAL_PROFILE, render
from repository.publish import publish_version

RAW_INPUT = "raw"
PREPROCESS_SUFFIX = "_preprocess"
RAW_SUFFIX = "_raw"
PREPROCESS_RUNNER = Path(__file__).with_name("raw_preprocess_model.py")
TRAINING = Path(__file__).resolve().parent.parent / "training"


def raw_kind(meta: dict[str, Any]) -> str | None:
    """image or text when the artifact's preprocessing can be served from raw bytes, else None."""
    pre = meta.get("preprocessing", {})
    if pre.get("kind") == "image":
        return "image"
    if pre.get("kind") == "text" and pre.get("vocab"):
        return "text"
    return None


def _preprocess_config(
    name: str, contract: ServingContract, target: str, opts: ConfigOptions
) -> mc.ModelConfig:
    spec = next(t for t in contract.inputs if t.name == target)
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=opts.max_batch_size)
    cfg.input.add(name=RAW_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    cfg.output.add(name=spec.name, data_type=DTYPES[spec.triton_dtype], dims=list(spec.dims))
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=opts.cpu_instances)
    cfg.version_policy.latest.num_versions = opts.keep_versions
    return cfg


def _ensemble_config(
    name: str, model: str, version: int, contract: ServingContract, target: str, opts: ConfigOptions
) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=opts.max_batch_size)
    cfg.input.add(name=RAW_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    for out in contract.outputs:
        t = cfg.output.add(name=out.name, data_type=DTYPES[out.triton_dtype], dims=list(out.dims))
        if out.label_filename:
            t.label_filename = out.label_filename
    pre = cfg.ensemble_scheduling.step.add(model_name=model + PREPROCESS_SUFFIX, model_version=version)
    pre.input_map[RAW_INPUT] = RAW_INPUT
    pre.output_map[target] = target
    step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=version)
    step.input_map[target] = target
    for out in contract.outputs:
        step.output_map[out.name] = out.name
    cfg.version_policy.latest.num_versions = opts.keep_versions
    return cfg


def publish_raw_models(
    repo: Path, name: str, version: int, meta: dict[str, Any], contract: ServingContract, opts: ConfigOptions
) -> list[Published]:
    """Publish `<name>_preprocess` and `<name>_raw` at `version`, beside version `version` of `name`."""
    kind = raw_kind(meta)
    if kind is None:
        return []
    if len(contract.inputs) != 1:
        return []  # raw bytes fill one input; a multi-input model takes tensors
    pre = meta["preprocessing"]
    target = contract.inputs[0].name
    params = {"kind": kind} | (
        {"size": pre["size"], "channels": pre["channels"]}
        if kind == "image"
        else {"vocab": pre["vocab"], "max_length": pre["max_length"], "dtype": contract.specs[0].dtype}
    )
    card = {"name": name, "kind": kind, "model_version": version, "preprocessing": params}
    published = []
    pre_name = name + PREPROCESS_SUFFIX
    staging = new_staging_dir(repo / pre_name)
    try:
        shutil.copy2(PREPROCESS_RUNNER, staging / "model.py")
        shutil.copy2(TRAINING / f"{kind}_preprocess.py", staging / f"{kind}_preprocess.py")
        (staging / "preprocess.json").write_text(json.dumps(params))
        (staging / CARD).write_text(json.dumps(card, indent=2))
        text = render(_preprocess_config(pre_name, contract, target, opts))
        files = {"config.pbtxt": text, f"configs/{LOCAL_PROFILE}.pbtxt": text}
        published.append(publish_version(repo / pre_name, staging, files, version))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    raw_name = name + RAW_SUFFIX
    staging = new_staging_dir(repo / raw_name)
    try:
        (staging / CARD).write_text(json.dumps(card, indent=2))
        text = render(_ensemble_config(raw_name, name, version, contract, target, opts))
        labels = "\n".join(contract.classes) + "\n"
        files = {"config.pbtxt": text, f"configs/{LOCAL_PROFILE}.pbtxt": text, "labels.txt": labels}
        published.append(publish_version(repo / raw_name, staging, files, version))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return published
