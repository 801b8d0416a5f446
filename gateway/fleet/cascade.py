"""Cascades: a served name answered by a chain of models (docs/cascade.md).

`Cascade` holds what the config declares (`cascades:`), the deferral rules its stages read
(gateway/fleet/cascade_rule.py, re-read on a config reload) and, for a stage behind another gateway,
the connection to it. The request's path through the stages is a pipeline step
(gateway/pipeline/cascade.py); `Mark` is what an answer says about it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import CascadeConfig, CascadeStageConfig, GatewayConfig, ServerConfig
from gateway.fleet.cascade_rule import DeferralRule, read_rule
from gateway.upstream.server import UpstreamServer
from gateway.upstream.tls import upstream_tls

logger = logging.getLogger(__name__)
# What an answer says about the cascade that produced it: response parameters (both protocols)
# and, under the same names with this prefix, HTTP headers and gRPC trailing metadata.
HEADER_PREFIX = "x-skewserve-"
STAGE, SCORE, RULE, OFFLINE = "cascade_stage", "cascade_score", "cascade_rule", "cascade_offline"
PARAMETERS = (STAGE, SCORE, RULE, OFFLINE)


def header_name(parameter: str) -> str:
    """cascade_stage -> x-skewserve-cascade-stage."""
    return HEADER_PREFIX + parameter.replace("_", "-")


@dataclass(frozen=True)
class Mark:
    """Which stage answered, the rule's score on the last answer it judged (None when no rule
    judged one: the first stage failed), the rules' tag, and whether a later stage that should
    have answered could not (`offline`: the answer is an earlier stage's)."""

    stage: str
    score: float | None
    rule: str
    offline: bool

    def parameters(self) -> dict[str, str | float | bool]:
        out: dict[str, str | float | bool] = {STAGE: self.stage, RULE: self.rule, OFFLINE: self.offline}
        if self.score is not None:
            out[SCORE] = round(self.score, 6)
        return out

    def headers(self) -> list[tuple[str, str]]:
        out = []
        for name, value in self.parameters().items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            out.append((header_name(name), text))
        return out

    @classmethod
    def from_parameters(cls, params: dict[str, Any]) -> Mark | None:
        """The mark a stored answer carries in its parameters (a cache hit), or None."""
        stage = params.get(STAGE)
        if not isinstance(stage, str):
            return None
        score = params.get(SCORE)
        return cls(
            stage,
            float(score) if isinstance(score, int | float) and not isinstance(score, bool) else None,
            str(params.get(RULE, "")),
            params.get(OFFLINE) is True,
        )


def check_rules(cfg: GatewayConfig) -> None:
    """Every cascade's rule files readable and whole (RuleError, a ConfigError, naming the file):
    checked where the config is loaded, so a bad rule stops the gateway before it listens."""
    for cascade in cfg.cascades:
        for stage in cascade.stages:
            if stage.rule is not None:
                read_rule(stage.rule)


class Stage:
    """One stage: where it sends (`remote` when behind another gateway), its deadline, its rule."""

    def __init__(self, cfg: CascadeStageConfig, connect_timeout_s: float, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.model = cfg.model
        self.rule: DeferralRule | None = read_rule(cfg.rule) if cfg.rule is not None else None
        self.headers: tuple[tuple[str, str], ...] = ()
        self.remote: UpstreamServer | None = None
        if cfg.gateway is not None:
            remote = cfg.gateway
            # Its own connections, never the HAProxy relay: the relay knows only this fleet's servers.
            self.remote = UpstreamServer(
                ServerConfig(name=f"cascade:{cfg.name}", http=remote.http, grpc=remote.grpc),
                "",
                10.0,
                connect_timeout_s,
                clock,
                tls=upstream_tls(remote.ca_file, remote.server_name) if remote.tls else None,
            )
            if remote.api_key_file is not None:
                self.headers = (("x-api-key", Path(remote.api_key_file).read_text().strip()),)


class Cascade:
    """A served name and its stages, in order."""

    def __init__(
        self, cfg: CascadeConfig, connect_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.stages = [Stage(s, connect_timeout_s, clock) for s in cfg.stages]

    @property
    def tag(self) -> str:
        """The rules' tags, stage by stage: in every answer and every cache key of the cascade."""
        return "+".join(s.rule.tag for s in self.stages if s.rule is not None)

    def read_rules(self) -> list[DeferralRule]:
        """Every stage's rule file read again (RuleError naming the file when one cannot be applied)."""
        return [read_rule(s.cfg.rule) for s in self.stages if s.cfg.rule is not None]

    def use_rules(self, rules: list[DeferralRule]) -> list[str]:
        """Apply rules from `read_rules` (no await: a request sees the old set or the new one);
        what changed, for the log."""
        changes = []
        judged = [s for s in self.stages if s.rule is not None]
        for stage, rule in zip(judged, rules, strict=True):
            assert stage.rule is not None
            if rule.digest != stage.rule.digest or rule.version != stage.rule.version:
                changes.append(f"cascade {self.name} stage {stage.name}: rule {stage.rule.tag} -> {rule.tag}")
            stage.rule = rule
        return changes

    async def close(self) -> None:
        for stage in self.stages:
            if stage.remote is not None:
                await stage.remote.close()

    def describe(self) -> dict[str, Any]:
        return {
            "rule": self.tag,
            "stages": [
                {
                    "name": s.name,
                    "model": s.model,
                    "region": s.cfg.region,
                    "gateway": None if s.cfg.gateway is None else s.cfg.gateway.http,
                    "deadline_s": s.cfg.deadline_s,
                    "rule": None
                    if s.rule is None
                    else {"tag": s.rule.tag, "kind": s.rule.kind, "path": s.rule.path},
                }
                for s in self.stages
            ],
        }
