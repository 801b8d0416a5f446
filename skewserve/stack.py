"""The local stack: real tritonserver processes per region, then the gateway in front of them.

Stack config (YAML or TOML):
    repository: model_repository          # Triton model repository
    model_config_name: local              # CPU profile (configs/local.pbtxt)
    model_control_mode: explicit          # the controller loads what each model's desired state serves
    controller: {interval_s: 1}           # its settings (controller/config.py); explicit mode only
    regions: {us-east: 2, eu-west: 1}     # servers per region
    response_cache_mb: 0                  # Triton's own response cache per server (MiB, 0: off)
    autoscale: {target: 2, max_servers: 4} # optional: servers per region follow their load (docs/autoscaling.md)
    gateway: {home_region: us-east, listen: {http_port: 8080, grpc_port: 8081, ops_port: 8082}, cache: {...}}
    edge: {servers: 1, gateway: {cascades: [...]}}  # optional: an edge site in front (skewserve/edge_tier.py)
The gateway section is a gateway config without `regions`: they are filled in from the servers.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import subprocess
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from controller.config import ControllerConfig
from controller.triton_admin import restricted_api_args
from gateway.config import GatewayConfig, RegionConfig, ServerConfig, format_validation_error
from skewserve.autoscale import AutoscalePolicy
from skewserve.edge_tier import EdgeTier, EdgeTierConfig, EdgeTierError, check_edge_config, resolve_paths
from skewserve.errors import SkewserveError
from skewserve.gateway_process import GatewayProcess, start_gateway_process
from skewserve.triton_process import TritonFleet, TritonServerSpec, response_cache_config

if TYPE_CHECKING:
    from controller.runner import ControllerThread
    from skewserve.local_autoscale import RegionAutoscaler
    from skewserve.loopback_dns import LoopbackDns


logger = logging.getLogger(__name__)
CONTROL_KEY_FILE = "control.key"
CONTROLLER_TOKENS_DIR = "controller-tokens"


class StackConfigError(SkewserveError):
    pass


class StackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repository: Path = Path("model_repository")
    model_config_name: str | None = "local"
    model_control_mode: str = "explicit"
    regions: dict[str, int] = Field(min_length=1, description="region name -> number of Triton servers")
    response_cache_mb: int = Field(
        default=0,
        ge=0,
        description="size of Triton's own response cache per server in MiB (0: off); models opt in "
        "with `skewserve export --response-cache`",
    )
    gateway: dict[str, Any] = Field(default_factory=dict)
    controller: ControllerConfig = Field(
        default_factory=lambda: ControllerConfig(interval_s=1.0),
        description="the model controller inside the stack (explicit model-control mode)",
    )
    autoscale: AutoscalePolicy | None = Field(
        default=None,
        description="scale each region's Triton servers on their load (skewserve up --autoscale); "
        "`regions` then gives the initial counts",
    )
    edge: EdgeTierConfig | None = Field(
        default=None,
        description="an edge site in front of the stack's gateway: its own CPU servers and a gateway "
        "serving cascades whose last stage is this stack (skewserve/edge_tier.py, docs/cascade.md)",
    )

    @field_validator("regions")
    @classmethod
    def _counts(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {r: n for r, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"each region needs at least one server, got {bad}")
        return v


def load_stack_config(path: Path) -> StackConfig:
    if not path.is_file():
        raise StackConfigError(f"stack config {path} does not exist")
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    try:
        cfg = StackConfig(**data)
    except ValidationError as exc:
        raise StackConfigError(format_validation_error(exc, str(path))) from exc
    if not cfg.repository.is_absolute():
        cfg.repository = (
            (path.parent / cfg.repository).resolve()
            if not cfg.repository.exists()
            else cfg.repository.resolve()
        )
    gw = dict(cfg.gateway)
    gw.setdefault("home_region", next(iter(cfg.regions)))
    try:
        GatewayConfig(
            **gw,
            regions=[
                RegionConfig(
                    name=r, servers=[ServerConfig(name=f"probe-{r}", http="127.0.0.1:1", grpc="127.0.0.1:2")]
                )
                for r in cfg.regions
            ],
        )
    except ValidationError as exc:
        raise StackConfigError(format_validation_error(exc, f"{path} (gateway section)")) from exc
    cfg.gateway = gw
    if cfg.edge is not None:
        cfg.edge = resolve_paths(cfg.edge, path.parent)
        try:
            check_edge_config(cfg.edge, gw, str(path))
        except EdgeTierError as exc:
            raise StackConfigError(str(exc)) from exc
    return cfg


class LocalStack:
    def __init__(self, config: StackConfig, log_dir: Path) -> None:
        self.config = config
        self.log_dir = Path(log_dir)
        # Only this stack's controller (and `skewserve rollout --config`, through the key file in
        # the log folder) may load or unload models on its servers.
        self.control_key = secrets.token_urlsafe(24)
        specs = [
            TritonServerSpec(
                repository=config.repository,
                region=region,
                name=f"{region}-{i}",
                model_config_name=config.model_config_name,
                model_control_mode=config.model_control_mode,
                cache_config=response_cache_config(config.response_cache_mb),
                extra_args=self.control_args(),
            )
            for region, n in config.regions.items()
            for i in range(n)
        ]
        # Autoscaled regions' servers belong to their RegionAutoscaler (skewserve/local_autoscale.py).
        self.fleet = TritonFleet([] if config.autoscale else specs, self.log_dir)
        self.autoscalers: list[RegionAutoscaler] = []
        self.dns: LoopbackDns | None = None
        self.gateway: GatewayProcess | None = None
        self.gateway_http = ""
        self.gateway_grpc = ""
        self.gateway_ops = ""  # host:port of the ops listener: /metrics, /admin/upstreams
        self.gateway_config_path = self.log_dir / "gateway.generated.yaml"
        self.controller: ControllerThread | None = None
        self.edge = (
            EdgeTier(config.edge, config.repository, config.model_config_name, self.log_dir)
            if config.edge is not None
            else None
        )

    @property
    def controlled(self) -> bool:
        return self.config.model_control_mode == "explicit"

    def control_args(self) -> tuple[str, ...]:
        """Explicit mode: the servers start empty and serve what the controller loads; the
        model-repository API answers only the controller's key; a loading model never makes a
        server unready (its other models keep serving)."""
        if not self.controlled:
            return ()
        return ("--strict-readiness=false", *restricted_api_args(self.control_key))

    def gateway_config(self) -> dict[str, Any]:
        cfg = dict(self.config.gateway)
        if self.autoscalers:
            cfg["regions"] = [{"name": a.region, "discover": a.discover} for a in self.autoscalers]
            return cfg
        cfg["regions"] = [
            {
                "name": region,
                "servers": [
                    {"name": s.spec.name, "http": s.http_address, "grpc": s.grpc_address} for s in servers
                ],
            }
            for region, servers in self.fleet.by_region().items()
        ]
        return cfg

    def _start_autoscalers(self) -> None:
        from skewserve.local_autoscale import RegionAutoscaler
        from skewserve.loopback_dns import LoopbackDns
        from skewserve.triton_dist import prepare_triton

        policy = self.config.autoscale
        assert policy is not None
        self.dns = LoopbackDns()
        prepared = prepare_triton()
        spec = {
            "repository": self.config.repository,
            "model_config_name": self.config.model_config_name,
            "model_control_mode": self.config.model_control_mode,
            "cache_config": response_cache_config(self.config.response_cache_mb),
            "extra_args": self.control_args(),
        }
        for index, (region, n) in enumerate(self.config.regions.items()):
            scaler = RegionAutoscaler(
                region,
                index,
                policy,
                spec,
                self.log_dir,
                prepared,
                self.dns,
                gateway_lists=functools.partial(self._gateway_lists_in, region),
            )
            self.autoscalers.append(scaler)
            scaler.add(max(policy.min_servers, min(policy.max_servers, n)), strict=True)

    def _gateway_lists_in(self, region: str, address: str) -> bool:
        return self._gateway_lists(f"{region}/{address}")  # discovered servers are named region/address

    def _gateway_lists(self, name: str) -> bool:
        """Does the gateway still hold server `name` (its ops listener's /admin/upstreams): route to
        it, or still drain requests sent to it before it left? A removed server's requests are in
        Triton's hands until the drain ends; stopped before that, Triton unloads the model under
        them (the admin page counts draining servers, not which, so any drain counts)."""
        if not self.gateway_ops:
            return False
        try:
            with urllib.request.urlopen(f"http://{self.gateway_ops}/admin/upstreams", timeout=5) as r:
                upstreams = json.loads(r.read())
            return bool(upstreams["servers_draining"]) or any(s["name"] == name for s in upstreams["servers"])
        except (OSError, ValueError, KeyError, TypeError):  # gateway gone or stopping: it routes nothing
            return False

    def start(self, timeout_s: float = 60.0) -> LocalStack:
        """Everything, in order; a start that fails part-way (or is interrupted) stops what it started."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> LocalStack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.autoscale:
            self._start_autoscalers()
        self.fleet.start()
        self.gateway_config_path.write_text(yaml.safe_dump(self.gateway_config()))
        if self.controlled:
            self._start_controller(timeout_s)
            if self.controller is not None:
                # the gateway follows canaries' traffic plans and, with placement by demand, asks the
                # controller for models no server holds
                tokens, token_file = self._controller_tokens()
                port = self.controller.serve_demand("127.0.0.1", 0, tokens)
                cfg = self.gateway_config()
                ask = {"controller_url": f"http://127.0.0.1:{port}", "token_file": str(token_file)}
                cfg.setdefault("traffic", ask)
                if self.config.controller.placement is not None:
                    cfg.setdefault("cold_start", ask)
                self.gateway_config_path.write_text(yaml.safe_dump(cfg))
        host = self.config.gateway.get("listen", {}).get("host", "127.0.0.1")
        self.gateway = start_gateway_process(
            self.gateway_config_path, self.log_dir / "gateway.log", host, timeout_s
        )
        self.gateway_http, self.gateway_grpc = self.gateway.http, self.gateway.grpc
        self.gateway_ops = self.gateway.ops
        for scaler in self.autoscalers:
            scaler.start_loop()
        if self.edge is not None:  # its cascades' last stage is the gateway just started
            self.edge.start((self.gateway_http, self.gateway_grpc), host, timeout_s)
        return self

    @property
    def gateway_proc(self) -> subprocess.Popen[bytes] | None:
        return self.gateway.proc if self.gateway is not None else None

    def _controller_tokens(self) -> tuple[Any, Path]:
        """The controller API's tokens: one caller, this stack's gateway, with a fresh token (a
        loopback port is still reachable by every local user)."""
        from controller.api_auth import CallerTokens

        folder = self.log_dir / CONTROLLER_TOKENS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        token_file = folder / "gateway"
        token_file.touch(mode=0o600)
        token_file.write_text(secrets.token_urlsafe(32))
        return CallerTokens(folder), token_file

    def _start_controller(self, timeout_s: float) -> None:
        """Run the controller and wait for its first pass: the gateway opens on loaded models."""
        from controller.runner import ControllerThread

        key_file = self.log_dir / CONTROL_KEY_FILE
        key_file.touch(mode=0o600)
        key_file.write_text(self.control_key)
        from controller.fleet import fleet_config
        from repository.disk_store import DiskStateStore

        gw = fleet_config(self.gateway_config_path)
        self.controller = ControllerThread(
            gw, DiskStateStore(self.config.repository), self.control_key, self.config.controller
        ).start()
        if not self.controller.wait_first_pass(max(timeout_s, self.config.controller.load_timeout_s)):
            raise StackConfigError(f"the model controller made no pass in {timeout_s:.0f}s")
        report = self.controller.last_report
        if report is not None and report.failures:
            logger.warning("models that failed to load: %s", "; ".join(report.failures))

    def stop(self) -> None:
        if self.edge is not None:
            self.edge.stop()  # its clients' requests end at the edge before the cloud goes
        for scaler in self.autoscalers:
            scaler.pause()  # no scaling while the gateway goes away
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        for scaler in self.autoscalers:
            scaler.stop()
        self.autoscalers = []
        if self.dns is not None:
            self.dns.close()
            self.dns = None
        self.fleet.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
