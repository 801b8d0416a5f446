"""Live config reload: SIGHUP (or a change of the file, when polled) re-reads the gateway config.

The new file is read and validated off the event loop, with the same environment overrides as at
start. It is applied only whole, or not at all (one log line says why, and the running config stays):

- an invalid file is refused with the validation message, which names the field;
- a change to a field that cannot change live (anything but `regions` and `home_region`: listen
  ports, cache backend, limits, ...) is refused with the fields named: restart to change them;
- otherwise regions and servers change in place, in an order that never lowers capacity before
  it is replaced: new regions join (empty), new servers are probed and join (routable once a probe
  said ready), discovery follows its new settings, the home region moves, then removed servers
  and regions leave routing and drain (closed once their in-flight requests finished).

Each step is a synchronous change between awaits, so a request is routed either before or after it,
never across a half-made fleet.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, GatewayConfig, RegionConfig, load_gateway_config
from gateway.core import Gateway
from gateway.upstream import UpstreamServer

logger = logging.getLogger(__name__)
LIVE_FIELDS = frozenset({"regions", "home_region"})


def changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the leaves that differ between two dumped configs (lists compared whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(old.keys() | new.keys()):
            out += changed_fields(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def fixed_field_changes(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Fields that differ and cannot change while the gateway runs."""
    return changed_fields(old.model_dump(exclude=set(LIVE_FIELDS)), new.model_dump(exclude=set(LIVE_FIELDS)))


async def apply_fleet(gw: Gateway, new: GatewayConfig) -> list[str]:
    """Make the gateway's regions and servers those of `new`; returns what changed, for the log."""
    old_regions = {r.name: r for r in gw.cfg.regions}
    new_regions = {r.name: r for r in new.regions}
    changes: list[str] = []
    for name, region_cfg in new_regions.items():
        if name not in gw.router.regions:
            gw.add_region(name, region_cfg.rtt_ms)
            changes.append(f"+region {name}")
        else:
            gw.router.regions[name].fixed_rtt_s = (
                None if region_cfg.rtt_ms is None else region_cfg.rtt_ms / 1000
            )
    leaving: list[UpstreamServer] = []
    joining: list[UpstreamServer] = []
    for name, region_cfg in new_regions.items():
        before = {s.name: s for s in _static(old_regions.get(name))}
        after = {s.name: s for s in region_cfg.servers}
        present = {s.name: s for s in gw.router.regions[name].servers}
        for server_name, server_cfg in after.items():
            if before.get(server_name) != server_cfg or server_name not in present:
                joining.append(gw.new_server(server_cfg, name))
        for server_name, server_cfg in before.items():
            if after.get(server_name) != server_cfg and server_name in present:
                leaving.append(present[server_name])
    # Replacements first: a server whose address changed is removed only once its successor is in.
    joined = await asyncio.gather(*(gw.add_server(s) for s in joining))
    changes += [f"+server {s.name}" for s, ok in zip(joining, joined, strict=True) if ok]
    await gw.discovery.reconfigure(new)
    if gw.router.home != new.home_region:
        changes.append(f"home {gw.router.home} -> {new.home_region}")
        gw.router.set_home(new.home_region)
    for server in leaving:
        gw.remove_server(server)
        changes.append(f"-server {server.name}")
    for name in old_regions.keys() - new_regions.keys():
        gw.remove_region(name)
        changes.append(f"-region {name}")
    gw.cfg = new
    return changes


def _static(region: RegionConfig | None) -> list[Any]:
    return [] if region is None else list(region.servers)


class ConfigReloader:
    """Re-reads `path` on request (SIGHUP) or when its content changes (polled); one reload at a time."""

    def __init__(self, gw: Gateway, path: Path) -> None:
        self.gw = gw
        self.path = path
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._watch: asyncio.Task[None] | None = None
        self._digest: bytes | None = None

    def request(self) -> None:
        """Schedule a reload (safe from a signal handler); reloads run one after another."""
        task = asyncio.get_running_loop().create_task(self.reload(), name="config-reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, why: str) -> bool:
        self.gw.reloads["refused"] += 1
        self.gw.reloads["last_refusal"] = why
        logger.error("config reload refused, keeping the running config: %s", why)
        return False

    async def reload(self) -> bool:
        """True when the file was applied; False (and one log line saying why) when refused."""
        async with self._lock:
            try:
                new = await asyncio.to_thread(load_gateway_config, self.path)
            except ConfigError as exc:
                return self._refuse(str(exc))
            fixed = fixed_field_changes(self.gw.cfg, new)
            if fixed:
                return self._refuse(
                    f"{', '.join(fixed)} cannot change while the gateway runs (only regions and "
                    f"home_region can): restart the gateway to change them, or revert them in {self.path}"
                )
            changes = await apply_fleet(self.gw, new)
            self.gw.reloads["applied"] += 1
            logger.info("config reloaded from %s: %s", self.path, ", ".join(changes) or "no fleet change")
            return True

    async def _file_digest(self) -> bytes | None:
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError:
            return None  # mid-swap (a ConfigMap update replaces a symlink): look again next time
        return hashlib.sha256(data).digest()

    async def _poll(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            digest = await self._file_digest()
            if digest is not None and digest != self._digest:
                self._digest = digest
                try:
                    await self.reload()
                except Exception:  # a reload bug must not stop watching the file
                    logger.exception("config reload failed")

    async def start(self) -> None:
        interval = self.gw.cfg.reload.watch_interval_s
        if interval > 0:
            self._digest = await self._file_digest()
            self._watch = asyncio.get_running_loop().create_task(self._poll(interval), name="config-watch")

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._watch] if self._watch is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watch = None
