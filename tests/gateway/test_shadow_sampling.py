"""Stratified shadow sampling, answer classes and the version override, without servers: the
parts of shadow traffic that are pure functions (the end-to-end test is
tests/controller/test_traffic_shares.py)."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from gateway.fleet.traffic_plan import ClassSampler, water_fill
from gateway.pipeline.answer_classes import grpc_classes, http_classes
from gateway.pipeline.shadow_send import version_field, versioned_path

FREQS = {"0": 0.70, "1": 0.20, "2": 0.07, "3": 0.025, "4": 0.005}


def test_water_fill_keeps_the_share_and_mirrors_rare_classes_whole() -> None:
    probs = water_fill(FREQS, 0.1)
    assert abs(sum(FREQS[c] * p for c, p in probs.items()) - 0.1) < 1e-9
    assert probs["4"] == 1.0 and probs["3"] > 0.9  # the even level (0.02375) is above class 3 nearly
    assert probs["0"] < probs["1"] < probs["2"] <= 1.0
    assert water_fill(FREQS, 1.0) == dict.fromkeys(FREQS, 1.0)


def test_stratified_sampling_mirrors_rare_classes_at_least_3x_uniform() -> None:
    rng = random.Random(7)
    stream = rng.choices(list(FREQS), weights=list(FREQS.values()), k=20_000)
    share = 0.1
    sampler = ClassSampler()
    stratified = dict.fromkeys(FREQS, 0)
    uniform = dict.fromkeys(FREQS, 0)
    for cls in stream:
        sampler.observe([cls])
        if rng.random() < sampler.probability(cls, share):
            stratified[cls] += 1
        if rng.random() < share:
            uniform[cls] += 1
    total = len(stream)
    # the same mirrored share (within sampling noise)...
    assert abs(sum(stratified.values()) / total - share) < 0.01
    # ...with the rarest classes mirrored several times more often
    for rare in ("3", "4"):
        assert stratified[rare] >= 3 * uniform[rare], (stratified, uniform)


def _probs(rows: list[list[float]]) -> np.ndarray:
    return np.asarray(rows, dtype=np.float32)


def test_http_classes_from_json_and_binary_answers() -> None:
    p = _probs([[0.1, 0.7, 0.2], [0.8, 0.1, 0.1]])
    as_json = json.dumps(
        {
            "outputs": [
                {"name": "probabilities", "datatype": "FP32", "shape": [2, 3], "data": p.ravel().tolist()}
            ]
        }
    ).encode()
    assert http_classes(as_json, None, "probabilities") == ["1", "0"]
    other = _probs([[5.0, 0.0]])
    head = json.dumps(
        {
            "outputs": [
                {
                    "name": "logits",
                    "datatype": "FP32",
                    "shape": [1, 2],
                    "parameters": {"binary_data_size": 8},
                },
                {
                    "name": "probabilities",
                    "datatype": "FP32",
                    "shape": [2, 3],
                    "parameters": {"binary_data_size": 24},
                },
            ]
        }
    ).encode()
    binary = head + other.tobytes() + p.tobytes()
    assert http_classes(binary, str(len(head)).encode(), "probabilities") == ["1", "0"]
    assert http_classes(b"not json", None, "probabilities") is None
    assert http_classes(as_json, None, "missing") == ["1", "0"]  # the only output


def test_grpc_classes_from_raw_contents() -> None:
    answer = pb.ModelInferResponse(model_name="m", model_version="1")
    out = answer.outputs.add()
    out.name, out.datatype = "probabilities", "FP32"
    out.shape.extend([1, 4])
    answer.raw_output_contents.append(struct.pack("<4f", 0.1, 0.2, 0.6, 0.1))
    assert grpc_classes(answer.SerializeToString(), "probabilities") == ["2"]
    assert grpc_classes(b"\xff\xff", "probabilities") is None


def test_version_field_overrides_the_clients_version_without_reencoding() -> None:
    req = pb.ModelInferRequest(model_name="m", model_version="7", id="x")
    raw = req.SerializeToString()
    pinned = pb.ModelInferRequest.FromString(raw + version_field("12"))
    assert (pinned.model_name, pinned.model_version, pinned.id) == ("m", "12", "x")
    assert versioned_path("a b", "3", b"?x=1") == b"/v2/models/a%20b/versions/3/infer?x=1"
