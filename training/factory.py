"""Models as plug-ins: a built-in family by name, or a user's `module:function` / `file.py:function`.

A factory is called as `factory(data: DataSpec, **args)` and returns an `nn.Module` whose
`forward(*inputs)` takes the DataSpec's inputs in order (batched, the batch on axis 0) and returns
float logits of shape [batch, classes]. The trainer and the exporter know models only through
this; the artifact records the factory (and a hash of a user's module file) so the exporter
rebuilds the same model.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.cnn import build_cnn
from training.data_spec import DataSpec
from training.errors import ModelError
from training.model import build_mlp
from training.text_model import build_text

Factory = Callable[..., nn.Module]
BUILTIN: dict[str, Factory] = {"mlp": build_mlp, "cnn": build_cnn, "text": build_text}


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings -> a dict; values read as JSON (numbers, true/false, lists), else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ModelError(f"--model-arg {pair!r} must be KEY=VALUE with KEY a Python name, e.g. width=64")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _load_user_factory(name: str) -> tuple[Factory, dict[str, Any]]:
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr:
        raise ModelError(
            f"unknown model {name!r}: use a built-in family ({', '.join(BUILTIN)}) or MODULE:FACTORY "
            "(an importable module, or a path to a .py file, then ':' and the function's name)"
        )
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            spec = importlib.util.spec_from_file_location(f"skewserve_user_model_{path.stem}", path)
            if spec is None or spec.loader is None or not path.is_file():
                raise FileNotFoundError(f"no such file {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            record: dict[str, Any] = {"kind": "file", "file": str(path)}
        else:
            if str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # a module beside the user, as `python -m` finds it
            module = importlib.import_module(target)
            record = {"kind": "module", "file": str(Path(module.__file__ or "").resolve())}
    except ModelError:
        raise
    except Exception as exc:  # an import runs the user's code: any error is the factory's
        raise ModelError(
            f"cannot import model factory {name!r}: {type(exc).__name__}: {exc}. Check the module is on "
            "PYTHONPATH (or give a path to its .py file) and imports cleanly"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model factory {name!r}: module {target!r} has no callable {attr!r}")
    file = Path(record["file"])
    record["sha256"] = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None
    return factory, record


def resolve(name: str) -> tuple[Factory, dict[str, Any]]:
    """The factory for a model name and the record of where it came from (kept in the artifact)."""
    if name in BUILTIN:
        return BUILTIN[name], {"kind": "builtin", "name": name}
    factory, record = _load_user_factory(name)
    return factory, {"name": name} | record


def build(name: str, args: dict[str, Any], data: DataSpec) -> tuple[nn.Module, dict[str, Any]]:
    """Call the factory; a refusal names the factory, what it accepts and what it got."""
    factory, record = resolve(name)
    try:
        model = factory(data, **args)
    except TypeError as exc:
        try:
            params = [p for p in inspect.signature(factory).parameters if p != "data"][1:] or list(
                inspect.signature(factory).parameters
            )[1:]
        except (TypeError, ValueError):
            params = []
        raise ModelError(
            f"model factory {name!r} refused its arguments {args}: {exc}; it accepts {params} "
            "(pass them with --model-arg KEY=VALUE)"
        ) from exc
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"model factory {name!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model, record | {"args": args}


def check_output(model: nn.Module, inputs: tuple[torch.Tensor, ...], data: DataSpec, name: str) -> None:
    """One forward pass on a real batch before the first step: logits must be float [batch, classes]."""
    shapes = ", ".join(
        f"{s.name} {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
        for s, t in zip(data.inputs, inputs, strict=True)
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(*inputs)
    except Exception as exc:
        raise ModelError(
            f"model {name!r} failed on a real batch ({shapes}): {type(exc).__name__}: {exc}. Its forward "
            f"must take {len(inputs)} tensor(s) in this order: {[s.name for s in data.inputs]}"
        ) from exc
    finally:
        model.train(was_training)
    want = (int(inputs[0].shape[0]), data.n_classes)
    if not isinstance(out, torch.Tensor):
        raise ModelError(
            f"model {name!r} returned {type(out).__name__} for a batch of {shapes}; return one tensor of "
            f"logits shaped [batch, classes] = {list(want)}"
        )
    if tuple(out.shape) != want or not out.is_floating_point():
        raise ModelError(
            f"model {name!r} returned {str(out.dtype).replace('torch.', '')} {list(out.shape)} for a batch of "
            f"{shapes}; it must return float logits shaped [batch, classes] = {list(want)}: make its last "
            f"layer output {data.n_classes} values per item (one per class) and do not apply softmax"
        )
