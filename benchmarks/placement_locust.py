"""Locust users of the placement benchmark: requests over many models with Zipf popularity, whose
ranking shifts once (the models ranked lowest become the hottest).

Set by benchmarks/placement_bench.py through the environment: PLACEMENT_MODELS (names, comma-
separated, hottest first), PLACEMENT_ZIPF_S, PLACEMENT_SHIFT_AT (epoch seconds), PLACEMENT_SHIFT
(ranks the ranking rotates by), PLACEMENT_RATE (requests per second per user). Request names are
the model's current popularity: `hot` (ranks 1-3), `warm` (4-10), `cold` (the rest).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import FastHttpUser, constant_throughput, task

MODELS = os.environ["PLACEMENT_MODELS"].split(",")
ZIPF_S = float(os.environ.get("PLACEMENT_ZIPF_S", "1.1"))
SHIFT_AT = float(os.environ["PLACEMENT_SHIFT_AT"])
SHIFT = int(os.environ.get("PLACEMENT_SHIFT", "15"))
WEIGHTS = [1.0 / (rank + 1) ** ZIPF_S for rank in range(len(MODELS))]
RANKS = list(range(len(MODELS)))
BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
).encode()


def popularity(rank: int) -> str:
    return "hot" if rank < 3 else "warm" if rank < 10 else "cold"


class ManyModelsUser(FastHttpUser):
    wait_time = constant_throughput(float(os.environ.get("PLACEMENT_RATE", "4")))

    @task
    def infer(self) -> None:
        rank = random.choices(RANKS, weights=WEIGHTS)[0]
        shifted = time.time() >= SHIFT_AT
        model = MODELS[(rank + SHIFT) % len(MODELS)] if shifted else MODELS[rank]
        with self.client.post(
            f"/v2/models/{model}/infer",
            data=BODY,
            headers={"Content-Type": "application/json"},
            name=popularity(rank),
            catch_response=True,
        ) as r:
            if r.status_code != 200:
                r.failure(f"{model}: HTTP {r.status_code} {r.text[:200]}")
