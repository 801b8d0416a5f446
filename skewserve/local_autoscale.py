"""`skewserve up --autoscale`: start and stop local Triton servers by the cluster's policy and signal.

Coupling to the gateway is one existing mechanism, DNS discovery: each region's servers listen on
their own loopback address (127.<10+region>.0.<n>, the same ports on each, like pods behind a
headless Service) and a `LoopbackDns` answers `triton.<region>.skewserve.local` with the addresses
of the ready ones. The gateway config names that DNS server (`regions[].discover.nameserver`).

- adding: the new server is started and ready first, then published; the gateway probes it and
  routes to it (as a pod becomes ready before its Service lists it);
- removing: the newest server is unpublished first; once the gateway no longer lists it (its
  discovery took it out of routing and drains in-flight requests) it is stopped with SIGTERM, which
  lets Triton finish what it holds. No request is sent to a stopping server.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skewserve.autoscale import (
    AutoscalePolicy,
    ScaleDecider,
    SignalWindow,
    TritonSample,
    parse_triton_metrics,
)
from skewserve.loopback_dns import LoopbackDns
from skewserve.ports import consecutive_free_ports
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec, stop_servers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScalePoint:
    """One control step, for the timeline plot and the tests."""

    t: float  # the controller's clock
    wall: float  # time.time(), to line up with load-generator histories
    servers: int
    signal: float
    desired: int


def shared_ports(hosts: list[str]) -> tuple[int, int, int]:
    """Three consecutive ports free on every host (every server of a region uses the same ports)."""
    http, grpc, metrics = consecutive_free_ports(hosts, 3)
    return http, grpc, metrics


class RegionAutoscaler:
    """Owns one region's Triton servers; `tick()` is one control step, `run()` repeats it."""

    def __init__(
        self,
        region: str,
        index: int,
        policy: AutoscalePolicy,
        spec: dict[str, Any],
        log_dir: Path,
        prepared: PreparedTriton,
        dns: LoopbackDns,
        gateway_lists: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.region = region
        self.policy = policy
        self.spec = spec  # TritonServerSpec fields shared by every server: repository, profile, cache
        self.log_dir = log_dir
        self.prepared = prepared
        self.dns = dns
        self.dns_name = f"triton.{region}.skewserve.local"
        self.gateway_lists = gateway_lists  # address -> does the gateway still route or drain to it?
        self.clock = clock
        self.hosts = [f"127.{10 + index}.0.{n + 1}" for n in range(policy.max_servers)]
        self.http_port, self.grpc_port, self.metrics_port = shared_ports(self.hosts)
        self.servers: dict[str, TritonServer] = {}  # address -> server, in start order
        self.decider = ScaleDecider(policy, clock)
        self.window = SignalWindow(policy)
        self.timeline: list[ScalePoint] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Servers launched and still loading (not yet in `servers`): `stop` stops them too. The lock
        # orders a launch against a stop, so no server is launched once the stop has looked.
        self._lock = threading.Lock()
        self._starting: list[TritonServer] = []
        self._closed = False  # `stop` has collected the servers to stop

    @property
    def discover(self) -> dict[str, Any]:
        """The gateway's `regions[].discover` section for this region."""
        return {
            "dns_name": self.dns_name,
            "http_port": self.http_port,
            "grpc_port": self.grpc_port,
            "interval_s": 0.5,
            "nameserver": self.dns.address,
        }

    # -- servers --------------------------------------------------------------------------
    def _new_server(self, host: str) -> TritonServer:
        return TritonServer(
            TritonServerSpec(
                **self.spec,
                region=self.region,
                name=f"{self.region}-{host}",
                host=host,
                http_port=self.http_port,
                grpc_port=self.grpc_port,
                metrics_port=self.metrics_port,
            ),
            self.log_dir,
            self.prepared,
        )

    def add(self, count: int, strict: bool = False) -> None:
        """Start `count` servers (loading overlaps), publish each once ready.

        strict (the initial servers): a server that does not start raises with Triton's reason;
        otherwise it is logged and left out, and the next decision tries again.
        """
        launch_error: BaseException | None = None
        with self._lock:  # a server is launched and counted as loading before a stop can look
            if self._stop.is_set():
                return
            busy = set(self.servers) | {s.spec.host for s in self._starting}
            started = [self._new_server(h) for h in self.hosts if h not in busy][:count]
            self._starting += started
            try:
                for server in started:
                    server._launch(self.prepared)
            except BaseException as exc:  # the OS refused a process: none of this step's may stay
                launch_error = exc
        if launch_error is not None:
            self._give_up(started)
            raise launch_error
        failure: Exception | None = None
        try:
            for server in started:
                try:
                    server._wait_ready()
                except Exception as exc:
                    if not self._stop.is_set():  # a stop ends loading servers: that is no failure
                        logger.warning(
                            "autoscaler: %s failed to start, not published: %s", server.spec.host, exc
                        )
                        failure = failure or exc
                    self._give_up([server])
                    continue
                self._ready(server)
        except BaseException:  # interrupted (Ctrl-C during the first servers' start): none is left running
            self._give_up(started)
            raise
        if self._stop.is_set():
            return
        if strict and failure is not None:
            raise failure
        self.dns.publish(self.dns_name, set(self.servers))
        logger.info("autoscaler %s: %d server(s) now", self.region, len(self.servers))

    def _ready(self, server: TritonServer) -> None:
        """A started server is ready: it joins `servers`, unless the final stop has already collected
        them (its thread outlived the stop's wait), in which case it is stopped here."""
        with self._lock:
            self._starting.remove(server)
            closed = self._closed
            if not closed:
                self.servers[server.spec.host] = server
        if closed:
            server.stop()

    def _give_up(self, servers: list[TritonServer]) -> None:
        """Stop servers of this step that will not be published, and stop counting them as loading."""
        with self._lock:
            self._starting = [s for s in self._starting if s not in servers]
            unpublished = [s for s in servers if self.servers.get(s.spec.host) is not s]
        stop_servers(unpublished)

    def remove(self, count: int) -> None:
        """Unpublish the newest servers, wait until the gateway dropped them, then stop them."""
        leaving = list(self.servers)[-count:]
        self.dns.publish(self.dns_name, set(self.servers) - set(leaving))
        deadline = time.monotonic() + 30
        while self.gateway_lists is not None:
            if not any(self.gateway_lists(a) for a in leaving):
                break
            if time.monotonic() >= deadline:
                logger.warning(
                    "autoscaler %s: the gateway still routes or drains to %s after 30s; stopping them anyway",
                    self.region,
                    ", ".join(leaving),
                )
                break
            time.sleep(0.1)
        with self._lock:
            gone = [self.servers.pop(address) for address in leaving if address in self.servers]
        stop_servers(gone)
        logger.info("autoscaler %s: %d server(s) now", self.region, len(self.servers))

    # -- control loop ---------------------------------------------------------------------
    def _sample(self) -> dict[str, TritonSample]:
        out: dict[str, TritonSample] = {}
        for address, server in list(self.servers.items()):
            try:
                with urllib.request.urlopen(server.metrics_url, timeout=2) as r:
                    out[address] = parse_triton_metrics(r.read().decode())
            except (urllib.error.URLError, OSError) as exc:  # one missed read: decide on the others
                logger.warning("autoscaler: metrics of %s unreadable: %s", address, exc)
        return out

    def tick(self) -> ScalePoint:
        samples = self._sample()
        now = self.clock()
        signal = self.window.add(now, samples)
        current = len(self.servers)
        desired = self.decider.decide(current, signal)
        point = ScalePoint(now, time.time(), current, signal, desired)
        self.timeline.append(point)
        if desired > current:
            logger.info(
                "autoscaler %s: %s=%.0f > target %.0f: %d -> %d",
                self.region,
                self.policy.signal,
                signal,
                self.policy.target,
                current,
                desired,
            )
            self.add(desired - current)
        elif desired < current:
            logger.info(
                "autoscaler %s: %s=%.0f after cool-down: %d -> %d",
                self.region,
                self.policy.signal,
                signal,
                current,
                desired,
            )
            self.remove(current - desired)
        return point

    def run(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            try:
                self.tick()
            except Exception:  # a failed step must not end autoscaling for good
                logger.exception("autoscaler %s: control step failed", self.region)

    def start_loop(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"autoscaler-{self.region}", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """No more scaling: the loop decides nothing more and no server is launched (servers keep
        running until `stop`)."""
        with self._lock:
            self._stop.set()

    def stop(self) -> None:
        """Stop the control loop and every server, those still loading included (an `add` waiting on
        them returns as they exit, publishing nothing)."""
        with self._lock:
            self._stop.set()
            loading = list(self._starting)
        stop_servers(loading)
        if self._thread is not None:
            self._thread.join(60)
        self.dns.publish(self.dns_name, set())
        with self._lock:
            self._closed = True  # a server that gets ready after this stops itself (`_ready`)
            servers = [*self.servers.values(), *self._starting]
            self.servers.clear()
        stop_servers(servers)


def plot_autoscaling(
    timeline: list[ScalePoint], policy: AutoscalePolicy, locust_histories: list[Path], out: Path
) -> Path:
    """Load, servers, signal and latency over time in one PNG (locust's `*_stats_history.csv`)."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, str]] = []
    for history in locust_histories:
        with open(history, newline="") as f:
            rows += [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    t0 = min([p.wall for p in timeline] + [float(r["Timestamp"]) for r in rows])

    def num(v: str) -> float:
        try:
            return float(v)
        except ValueError:
            return float("nan")

    lt = [float(r["Timestamp"]) - t0 for r in rows]
    fig, (load, scale, lat) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    load.plot(lt, [num(r["Requests/s"]) for r in rows], ".", ms=3, color="tab:green", label="requests/s")
    load.plot(lt, [num(r["Failures/s"]) for r in rows], ".", ms=3, color="tab:red", label="failures/s")
    users = load.twinx()
    users.plot(lt, [num(r["User Count"]) for r in rows], ".", ms=3, color="tab:gray", label="users")
    users.set_ylabel("locust users")
    load.set_ylabel("requests/s")
    load.legend(loc="upper left")
    st = [p.wall - t0 for p in timeline]
    scale.step(st, [p.servers for p in timeline], where="post", color="tab:blue", label="Triton servers")
    scale.set_ylabel("servers")
    scale.set_ylim(0, policy.max_servers + 0.5)
    sig = scale.twinx()
    sig.plot(
        st,
        [p.signal / 1000 if policy.signal == "queue_us" else p.signal for p in timeline],
        color="tab:orange",
        lw=0.8,
        label=f"signal ({policy.signal})",
    )
    target = policy.target / 1000 if policy.signal == "queue_us" else policy.target
    sig.axhline(target, color="tab:orange", ls="--", lw=0.8, label="target")
    sig.set_ylabel("queue ms / request" if policy.signal == "queue_us" else "in flight / server")
    scale.legend(loc="upper left")
    sig.legend(loc="upper right")
    lat.plot(lt, [num(r["50%"]) for r in rows], ".", ms=3, label="p50")
    lat.plot(lt, [num(r["95%"]) for r in rows], ".", ms=3, label="p95")
    lat.set_ylabel("latency (ms)")
    lat.set_xlabel("seconds")
    lat.legend(loc="upper left")
    for ax in (load, scale, lat):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"skewserve up --autoscale: target {policy.target:g} ({policy.signal}), "
        f"cool-down {policy.scale_down_window_s:g}s"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
