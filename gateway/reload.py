"""Live config reload: SIGHUP (or a change of the file, when polled) re-reads the gateway config.

The new file is read and validated off the event loop, with the same environment overrides as at
start. It is applied only whole, or not at all (one log line says why, and the running config stays):

- an invalid file is refused with the validation message, which names the field;
- a change to a field that cannot change live (anything but `regions`, `home_region` and
  `auth.keys`: listen ports, cache backend, limits, ...) is refused with the fields named: restart
  to change them. Keys change live (a leaked key is revoked by removing it), but turning
  authentication on or off does not: it switches rate limits between per client and per key;
- otherwise regions and servers change in place, whole or not at all (`apply_fleet`): new servers
  are probed aside, new regions join empty and discovery follows its new settings; a failure there
  is undone and refused with its cause. Then, in one synchronous step, new servers join (routable
  once a probe said ready), the home region moves, and removed servers and regions leave routing
  and drain (closed once their in-flight requests finished), so capacity is never lowered before
  it is replaced and a request is routed either before or after the change, never across it.
  The new key list takes effect in the same step (unchanged keys keep their rate buckets).
- the deferral rules of cascades (`cascades[].stages[].rule`, docs/cascade.md) are read again
  (their paths cannot change live, their content can): a rule that cannot be applied refuses the
  reload; otherwise each cascade's rules change in the same step. A rule's digest is in every cache
  key of its cascade, so an answer cached under the old rule is never served under the new one.
  With `reload.watch_interval_s`, a change of a rule file reloads as a change of the config does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, GatewayConfig, RegionConfig, load_gateway_config
from gateway.core import Gateway
from gateway.fleet.cascade_rule import DeferralRule
from gateway.task_stop import cancel_all_and_wait
from gateway.upstream.server import FLEET_CHANGES, UpstreamServer

logger = logging.getLogger(__name__)
LIVE_FIELDS = frozenset({"regions", "home_region", "auth.keys"})


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
    changed = changed_fields(old.model_dump(), new.model_dump())
    return [f for f in changed if not any(f == live or f.startswith(live + ".") for live in LIVE_FIELDS)]


def auth_switch(old: GatewayConfig, new: GatewayConfig) -> str | None:
    """Why a reload may not turn authentication on or off, or None."""
    if bool(old.auth.keys) == bool(new.auth.keys):
        return None
    return (
        f"auth.keys: turning authentication {'on' if new.auth.keys else 'off'} cannot happen live (rate "
        "limits switch between per client and per key): restart the gateway"
    )


class ReloadFailed(Exception):
    """Applying a valid config failed part-way; everything it had changed was undone."""


async def apply_fleet(gw: Gateway, new: GatewayConfig) -> list[str]:
    """Make the gateway's regions and servers those of `new`, whole or not at all.

    Everything that awaits comes first and changes no routing: joining servers are probed aside,
    new regions are added empty (routing skips a region without servers) so discovery can fill
    them, and discovery follows its new settings. If any of that fails, it is undone (probed
    servers closed, added regions removed, discovery back on the old settings) and ReloadFailed
    says why. Only then, in one synchronous block no request can interleave with, servers join
    and leave, the home region moves and `gw.cfg` becomes `new`.
    """
    old = gw.cfg
    old_regions = {r.name: r for r in old.regions}
    new_regions = {r.name: r for r in new.regions}
    leaving: list[UpstreamServer] = []
    joining: list[UpstreamServer] = []
    for name, region_cfg in new_regions.items():
        before = {s.name: s for s in _static(old_regions.get(name))}
        after = {s.name: s for s in region_cfg.servers}
        region = gw.router.regions.get(name)
        present = {s.name: s for s in region.servers} if region is not None else {}
        for server_name, server_cfg in after.items():
            if before.get(server_name) != server_cfg or server_name not in present:
                joining.append(gw.new_server(server_cfg, name))
        for server_name, server_cfg in before.items():
            if after.get(server_name) != server_cfg and server_name in present:
                leaving.append(present[server_name])
    added = [name for name in new_regions if name not in gw.router.regions]
    try:
        await asyncio.gather(*(gw.health.probe(s) for s in joining))
        for name in added:
            gw.add_region(name, new_regions[name].rtt_ms)
        try:
            await gw.discovery.reconfigure(new)
        except Exception as exc:
            for name in added:
                gw.remove_region(name)
            await gw.discovery.reconfigure(old)
            raise ReloadFailed(f"discovery could not follow the new config: {exc}") from exc
    except BaseException:
        await asyncio.gather(*(s.close() for s in joining), return_exceptions=True)
        raise
    # -- the commit: no await from here on -------------------------------------------------------
    changes = [f"+region {name}" for name in added]
    for name, region_cfg in new_regions.items():
        gw.router.regions[name].fixed_rtt_s = None if region_cfg.rtt_ms is None else region_cfg.rtt_ms / 1000
    FLEET_CHANGES.bump()  # a fixed RTT changed the nearest-region order, maybe
    for server in joining:
        gw.attach_server(server)  # its region exists: added above, or kept
        changes.append(f"+server {server.name}")
    if gw.router.home != new.home_region:
        changes.append(f"home {gw.router.home} -> {new.home_region}")
        gw.router.set_home(new.home_region)
    for server in leaving:
        gw.remove_server(server)
        changes.append(f"-server {server.name}")
    for name in old_regions.keys() - new_regions.keys():
        gw.remove_region(name)
        changes.append(f"-region {name}")
    if new.auth.keys != old.auth.keys:
        gw.auth = gw.auth.with_keys(new.auth)
        removed = {k.name for k in old.auth.keys} - {k.name for k in new.auth.keys}
        changes.append(
            f"API keys: {len(new.auth.keys)}" + (f", revoked {', '.join(sorted(removed))}" if removed else "")
        )
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
                    f"{', '.join(fixed)} cannot change while the gateway runs (only regions, home_region "
                    f"and auth.keys can): restart the gateway to change them, or revert them in {self.path}"
                )
            switch = auth_switch(self.gw.cfg, new)
            if switch is not None:
                return self._refuse(switch)
            try:
                rules = await asyncio.to_thread(self._read_rules)
            except ConfigError as exc:
                return self._refuse(str(exc))
            try:
                changes = await apply_fleet(self.gw, new)
            except ReloadFailed as exc:
                return self._refuse(str(exc))
            for name, cascade_rules in rules.items():  # no await since apply_fleet's commit
                changes += self.gw.cascades[name].use_rules(cascade_rules)
            self.gw.reloads["applied"] += 1
            logger.info("config reloaded from %s: %s", self.path, ", ".join(changes) or "no fleet change")
            return True

    def _read_rules(self) -> dict[str, list[DeferralRule]]:
        return {name: cascade.read_rules() for name, cascade in self.gw.cascades.items()}

    def _watched(self) -> list[Path]:
        """The config file and the rule files it names."""
        rules = [Path(s.cfg.rule) for c in self.gw.cascades.values() for s in c.stages if s.cfg.rule]
        return [self.path, *rules]

    async def _file_digest(self) -> bytes | None:
        try:
            data = await asyncio.to_thread(lambda: [p.read_bytes() for p in self._watched()])
        except OSError:
            return None  # mid-swap (a ConfigMap update replaces a symlink): look again next time
        h = hashlib.sha256()
        for part in data:
            h.update(hashlib.sha256(part).digest())
        return h.digest()

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
        await cancel_all_and_wait(tasks)
        self._watch = None
