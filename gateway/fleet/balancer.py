"""Balancing within a region: power of two choices over EWMA latency x outstanding requests.

P2C (Mitzenmacher 2001) with a latency-weighted load, as in Finagle's "P2C + peak EWMA" and
Envoy's least-request balancer: pick two servers at random and take the one whose
latency x (in-flight + 1) is lower. A slow server's EWMA rises and it is picked less, without
the herd behaviour of always choosing the global minimum. Round-robin is kept for comparison.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from gateway.upstream.server import UpstreamServer


class Balancer(Protocol):
    def pick(self, servers: Sequence[UpstreamServer]) -> UpstreamServer: ...


class P2CEwmaBalancer:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, servers: Sequence[UpstreamServer]) -> UpstreamServer:
        n = len(servers)
        if n == 1:
            return servers[0]
        i = int(self.rng.random() * n)
        j = int(self.rng.random() * (n - 1))
        if j >= i:
            j += 1
        a, b = servers[i], servers[j]
        return a if a.score() <= b.score() else b


class RoundRobinBalancer:
    def __init__(self) -> None:
        self.counter = 0

    def pick(self, servers: Sequence[UpstreamServer]) -> UpstreamServer:
        self.counter += 1
        return servers[self.counter % len(servers)]


def make_balancer(policy: str) -> Balancer:
    return P2CEwmaBalancer() if policy == "p2c_ewma" else RoundRobinBalancer()
