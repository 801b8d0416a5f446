"""Which servers hold which model: what routing reads per request, built once per fleet change.

Routing used to walk every server of the fleet for each request (the servers with the model in
each region, the highest version ready anywhere, whether a name is known at all): with the cache
on, a fleet of 150 servers cost about 50 µs of a request's CPU in the highest version alone, more
than the rest of the routing. The index answers those from dicts. It is rebuilt when a server's
models or the set of servers change (`FLEET_CHANGES` in gateway/upstream/server.py counts them; a
health probe that finds what it found before changes nothing), so its answers are the walk's
answers at the time of the request. What changes between probes without changing what a server
holds (health, ejection, in-flight load) is still read from the server per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from gateway.upstream.server import FLEET_CHANGES, UpstreamServer

_NONE: Final[list[UpstreamServer]] = []


def _number(version: str) -> int:
    """A version's number, or -1 when it has none (a name, "²", digits beyond int()'s limit): one
    server reporting an odd version must not make every request's routing raise."""
    if not (version.isascii() and version.isdigit()):
        return -1
    try:
        return int(version)
    except ValueError:
        return -1


class ModelIndex:
    def __init__(self) -> None:
        self.built_at = -1  # FLEET_CHANGES.count when built: never yet
        self.builds = 0
        # region -> model -> the region's servers holding some version of it, in the region's order
        self._holders: dict[str, dict[str, list[UpstreamServer]]] = {}
        self._versions: dict[str, set[str]] = {}  # model -> every version ready on some server
        self._latest: dict[str, str] = {}  # model -> its highest numbered version ready anywhere
        self._known: set[str] = set()  # every model some server has ever held

    def stale(self) -> bool:
        return self.built_at != FLEET_CHANGES.count

    def build(self, regions: Iterable[tuple[str, list[UpstreamServer]]]) -> None:
        built_at = FLEET_CHANGES.count
        holders: dict[str, dict[str, list[UpstreamServer]]] = {}
        versions: dict[str, set[str]] = {}
        known: set[str] = set()
        for name, servers in regions:
            held: dict[str, list[UpstreamServer]] = {}
            for server in servers:
                for model, ready in server.ready_models.items():
                    if ready:  # as UpstreamServer.has_model: a model with no version is not held
                        held.setdefault(model, []).append(server)
                        versions.setdefault(model, set()).update(ready)
                known |= server.known_models
            holders[name] = held
        latest: dict[str, str] = {}
        for model, ready in versions.items():
            numbered = [n for n in map(_number, ready) if n >= 0]
            if numbered:
                latest[model] = str(max(numbered))
        self._holders, self._versions, self._latest, self._known = holders, versions, latest, known
        self.built_at = built_at
        self.builds += 1

    def holders(self, region: str, model: str) -> list[UpstreamServer]:
        """The region's servers holding some version of `model` (a superset of those that can take
        a request for it now: health, ejection and the version are the caller's to check)."""
        return self._holders.get(region, {}).get(model, _NONE)

    def latest(self, model: str) -> str:
        """The highest numbered version of `model` ready anywhere, or "" when none is."""
        return self._latest.get(model, "")

    def listed(self, model: str, version: str) -> bool:
        """Some server has `version` of `model` ready (as last probed)."""
        return version in self._versions.get(model, ())

    def known(self, model: str) -> bool:
        return model in self._known
