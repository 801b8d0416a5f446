"""The control plane under faults (`make chaos`): skewed locust traffic through the gateway onto two
real tritonservers while storage calls fail, the controller leader and the servers are killed, and
a rollout and a rollback run. A benchmark, not a test: it prints what happened, against the goals.

The stack: moto's S3 server holding the model repository (two models published from a small
trained artifact), the fault proxy in front of it (loadtests/s3_faults.py) failing `--fault-fraction`
of the controllers' storage calls (503 SlowDown, hung calls, empty and partial listings, slow
reads), `--controllers` `skewserve controller --leader-election` processes on the repository through
the proxy, two tritonservers in explicit model control reading the bucket's copy
(benchmarks/chaos_fleet.py), and the gateway, whose traffic plans come from whichever replica leads.

Faults during `--minutes` of load: the leader SIGKILLed every `--leader-every` s and restarted, a
tritonserver (in turn) SIGKILLed every `--triton-every` s and restarted; at a quarter of the run a
second version of the hot model is published and rolled out (`skewserve rollout`, its canary checked
on every server), at 60% rolled back (`skewserve rollback`).

Printed: failed client requests (all, and those for a model some live server had loaded at that
second), unloads of versions the desired state served at that moment (sampled from the servers
every 0.5 s, restarts excluded), the time to converge after each fault (leader killed: until a
replica leads and finished a pass; server killed: until it serves every served version again;
rollout and rollback: until the desired state and every server agree), promotions completed.

Usage: python benchmarks/chaos.py [--minutes 10] [--seed 0] [--out runs/chaos]
"""

from __future__ import annotations

import argparse
import csv
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from chaos_fleet import BucketMirror, ControllerReplica, LeaderAddress  # noqa: E402

from controller.triton_admin import TritonAdmin, restricted_api_args  # noqa: E402
from loadtests.s3_faults import KINDS, FaultPlan, S3FaultProxy  # noqa: E402
from repository.object_store import ObjectStateStore  # noqa: E402
from repository.s3 import s3_client  # noqa: E402
from skewserve.gateway_process import GatewayProcess, start_gateway_process  # noqa: E402
from skewserve.ports import free_port  # noqa: E402
from skewserve.triton_dist import prepare_triton  # noqa: E402
from skewserve.triton_process import TritonServer, TritonServerSpec  # noqa: E402

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "chaos-access-key",
    "AWS_SECRET_ACCESS_KEY": "chaos-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET, PREFIX = "chaos", "models"
HOT, COLD = "lt", "lt_cold"
MODELS = (HOT, COLD)
REGION = "local"
SKEWSERVE = [sys.executable, "-m", "skewserve"]  # the command line, as an operator runs it


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- what was observed --------------------------------------------------------------------------
@dataclass
class Observations:
    started: float = 0.0  # monotonic start of the load
    leader_kills: list[tuple[float, float | None]] = field(default_factory=list)  # (at, converged after)
    triton_kills: list[tuple[str, float, float | None]] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)  # served versions that went away, not by a restart
    served_at: dict[int, dict[str, bool]] = field(default_factory=dict)  # epoch second -> model -> held
    two_leaders: int = 0  # samples where two replicas said they lead
    no_leader_s: float = 0.0
    samples: int = 0
    events: list[str] = field(default_factory=list)

    def at(self) -> float:
        return time.monotonic() - self.started


class Watcher:
    """Every 0.5 s: the desired states (from the store directly, no faults), what each live server has
    READY, which replica leads; unloads of served versions and convergence after faults from them."""

    def __init__(self, obs: Observations, store: ObjectStateStore, servers: dict[str, TritonServer],
                 replicas: list[ControllerReplica], key: str) -> None:  # fmt: skip
        self.obs, self.store, self.servers, self.replicas, self.key = obs, store, servers, replicas, key
        self.down: set[str] = set()  # servers killed and not yet restarted
        self.incarnation: dict[str, int] = dict.fromkeys(servers, 0)
        self.pending_servers: dict[str, tuple[int, float]] = {}  # name -> (kill index, killed at)
        self.pending_leader: tuple[int, float, dict[int, float]] | None = None
        self.leader_slot: int | None = None
        self.leader_metrics: dict[int, dict[str, float]] = {}
        self.last_loaded: dict[str, tuple[int, dict[str, list[int]]]] = {}
        self.last_served: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-watcher")
        self.lock = threading.Lock()

    def served(self) -> dict[str, set[int]]:
        out = {}
        for model in MODELS:
            try:
                state = self.store.current(model)
            except Exception:  # noqa: BLE001 - moto busy: this sample keeps the last reading
                return dict(self.last_served)
            out[model] = set(state.served) if state is not None else set()
        return out

    def loaded(self, name: str) -> dict[str, list[int]] | None:
        server = self.servers[name]
        if name in self.down or not server.is_running():
            return None
        admin = TritonAdmin(name, server.http_address, self.key, 5.0)
        try:
            return admin.loaded()
        except Exception:  # noqa: BLE001 - starting or busy: not observed this sample
            return None
        finally:
            admin.close()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        obs = self.obs
        before = self.served()
        with self.lock:
            seen = {n: (self.incarnation[n], self.loaded(n)) for n in self.servers}
        after = self.served()
        steady = {
            m: before.get(m, set()) & after.get(m, set()) & self.last_served.get(m, set()) for m in MODELS
        }
        second = int(time.time())
        held = obs.served_at.setdefault(second, dict.fromkeys(MODELS, False))
        for name, (life, loaded) in seen.items():
            if loaded is None:
                continue
            for model in MODELS:
                if set(loaded.get(model, [])) & after.get(model, set()):
                    held[model] = True
            prev = self.last_loaded.get(name)
            if prev is not None and prev[0] == life:
                for model in MODELS:
                    gone = set(prev[1].get(model, [])) - set(loaded.get(model, []))
                    for v in sorted(gone & steady[model]):
                        line = f"{obs.at():6.1f}s {name}: {model} version {v} unloaded while served"
                        obs.unloads.append(line)
                        log(line)
            self.last_loaded[name] = (life, loaded)
            pending = self.pending_servers.get(name)
            if pending is not None and all(after.get(m, set()) <= set(loaded.get(m, [])) for m in MODELS):
                index, killed = pending
                took = time.monotonic() - killed
                kind, at, _ = obs.triton_kills[index]
                obs.triton_kills[index] = (kind, at, took)
                del self.pending_servers[name]
                log(f"{name} serves every served version again, {took:.1f}s after it was killed")
        self.last_served = after
        metrics = {r.slot: m for r in self.replicas if (m := r.metrics()) is not None}
        leaders = [s for s, m in metrics.items() if m.get("skewserve_controller_leader") == 1.0]
        obs.samples += 1
        obs.two_leaders += len(leaders) > 1
        obs.no_leader_s += 0.5 if not leaders else 0.0
        self.leader_slot = leaders[0] if len(leaders) == 1 else None
        self.leader_metrics = metrics
        if self.pending_leader is not None and len(leaders) == 1:
            index, killed, baseline = self.pending_leader
            slot = leaders[0]
            if metrics[slot].get("skewserve_controller_passes", 0) > baseline.get(slot, 0):
                took = time.monotonic() - killed
                obs.leader_kills[index] = (obs.leader_kills[index][0], took)
                self.pending_leader = None
                log(f"controller-{slot} leads and finished a pass, {took:.1f}s after the leader was killed")

    def leader_port(self) -> int | None:
        slot = self.leader_slot
        return next((r.port for r in self.replicas if r.slot == slot), None) if slot is not None else None

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# -- the stack ----------------------------------------------------------------------------------
def start_moto(log_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    moto = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    with open(log_dir / "moto.log", "wb") as out:
        proc = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}; see {log_dir / 'moto.log'}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
            return proc, port
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto_server did not answer within 60 s")


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(30)


def train_artifact(work: Path) -> Path:
    from training.config import TrainConfig
    from training.launch import train
    from training.synth import SynthSpec, write

    data, out = work / "data", work / "artifact"
    write(SynthSpec(n_classes=5, imbalance_ratio=20, n_max=400, n_features=8, n_informative=6,
                    n_val_per_class=40, n_test_per_class=40, seed=2), data)  # fmt: skip
    train(TrainConfig(data_dir=data, out_dir=out, epochs=4, width=32, progress=False))
    return out


def publish(artifact: Path, repo_url: str, model: str) -> int:
    from exporter.pipeline import export_artifact

    return export_artifact(artifact, repo_url, model, tensorrt="off").published.version


def triton(mirror: Path, name: str, key: str, log_dir: Path, prepared: Any) -> TritonServer:
    return TritonServer(
        TritonServerSpec(
            repository=mirror, region=REGION, name=name, model_control_mode="explicit",
            http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
            extra_args=("--strict-readiness=false", *restricted_api_args(key)),
        ),
        log_dir,
        prepared,
    )  # fmt: skip


def run_command(cmd: list[str], env: dict[str, str], out: Path) -> tuple[int, float, str]:
    started = time.monotonic()
    with open(out, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    text = out.read_text(errors="replace").strip().splitlines()
    return rc, time.monotonic() - started, (text[-1] if text else "")


def wait_for(what: str, predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


# -- the run ------------------------------------------------------------------------------------
def main() -> None:  # noqa: PLR0915 - one scenario, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of load under faults")
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults drawn and the traffic")
    parser.add_argument("--controllers", type=int, default=3, help="controller replicas")
    parser.add_argument("--fault-fraction", type=float, default=0.05, help="share of storage calls failed")
    parser.add_argument("--fault-kinds", default=",".join(KINDS))
    parser.add_argument("--hang-s", type=float, default=10.0, help="how long a hung storage call is held")
    parser.add_argument("--leader-every", type=float, default=60.0, help="seconds between leader kills")
    parser.add_argument("--triton-every", type=float, default=90.0, help="seconds between server kills")
    parser.add_argument("--leader-lease", type=float, default=15.0, help="the replicas' --leader-lease")
    parser.add_argument("--users", type=int, default=4, help="locust users (back to back requests)")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"), help="logs and locust files")
    args = parser.parse_args()
    work = args.out.resolve()
    shutil.rmtree(work, ignore_errors=True)
    logs = work / "logs"
    logs.mkdir(parents=True)
    os.environ.update(CREDENTIALS)
    key = secrets.token_urlsafe(24)
    duration = args.minutes * 60
    obs = Observations()
    stack: list[Any] = []  # stopped in reverse
    try:
        moto, moto_port = start_moto(logs)
        stack.append(lambda: _end(moto))
        direct_url = f"s3://127.0.0.1:{moto_port}/{BUCKET}/{PREFIX}"
        client = s3_client(f"http://127.0.0.1:{moto_port}")
        client.create_bucket(Bucket=BUCKET)
        log("training a small artifact and publishing lt and lt_cold (version 1)")
        artifact = train_artifact(work)
        for model in MODELS:
            publish(artifact, direct_url, model)
        mirror = BucketMirror(client, BUCKET, PREFIX, work / "mirror")
        mirror.sync()

        plan = FaultPlan(args.fault_fraction, tuple(args.fault_kinds.split(",")), hang_s=args.hang_s)
        proxy = S3FaultProxy(("127.0.0.1", moto_port), seed=args.seed, on_stored=mirror.on_stored).start()
        stack.append(proxy.stop)
        repo_url = f"s3://127.0.0.1:{proxy.port}/{BUCKET}/{PREFIX}"

        prepared = prepare_triton()
        servers = {n: triton(work / "mirror", n, key, logs, prepared) for n in ("triton-0", "triton-1")}
        for server in servers.values():
            server.start()
            stack.append(server.stop)

        tokens = work / "controller-tokens"
        tokens.mkdir(mode=0o700)
        (tokens / "gateway").write_text(secrets.token_urlsafe(32))
        replicas: list[ControllerReplica] = []
        watcher = Watcher(obs, ObjectStateStore(direct_url, client), servers, replicas, key)
        leader = LeaderAddress(watcher.leader_port).start()
        stack.append(leader.stop)
        gw_cfg = {
            "home_region": REGION,
            "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
            "cache": {"backend": "none"},  # every request reaches a server
            "health": {"interval_s": 0.5},
            "traffic": {"controller_url": f"http://127.0.0.1:{leader.port}", "token_file": str(tokens / "gateway")},
            "regions": [{"name": REGION, "servers": [
                {"name": n, "http": s.http_address, "grpc": s.grpc_address} for n, s in servers.items()
            ]}],
        }  # fmt: skip
        gw_path = work / "gateway.yaml"
        gw_path.write_text(yaml.safe_dump(gw_cfg))

        env = {**os.environ, "SKEWSERVE_CONTROL_KEY": key}
        controller_args = ["--config", str(gw_path), "--repo", repo_url, "--interval", "1", "--leader-election",
                           "--leader-lease", str(args.leader_lease), "--tokens-dir", str(tokens), "--load-timeout", "120"]  # fmt: skip
        for slot in range(args.controllers):
            replica = ControllerReplica(slot, free_port(), controller_args, env, logs)
            replica.start()
            replicas.append(replica)
            stack.append(replica.stop)
        watcher.start()
        stack.append(watcher.stop)
        log(
            f"{args.controllers} controllers on {repo_url}; waiting for a leader to load both models everywhere"
        )
        wait_for(
            "a leader and both models on both servers",
            lambda: (
                watcher.leader_slot is not None
                and all(all(m in (watcher.loaded(n) or {}) for m in MODELS) for n in servers)
            ),
            240,
        )
        gateway: GatewayProcess = start_gateway_process(gw_path, logs / "gateway.log")
        stack.append(gateway.stop)

        from loadtests.mix import MixSettings
        from loadtests.runner import LoadTestSpec, model_inputs, run_loadtest

        target = f"http://{gateway.http}"
        wait_for("the gateway to serve lt", lambda: _answers(target, HOT), 60)
        spec = LoadTestSpec(
            target=target, protocol="http-binary", users=args.users, spawn_rate=args.users, duration_s=duration,
            out_dir=work / "locust",
            mix=MixSettings(model=HOT, inputs=model_inputs(target, "http", HOT), keys=1000, zipf_s=1.1,
                            cold_model=COLD, cold_fraction=0.2, seed=args.seed),
        )  # fmt: skip
        loadtest: dict[str, Any] = {}
        load_thread = threading.Thread(target=lambda: loadtest.update(result=run_loadtest(spec)), daemon=True)
        proxy.plan = plan
        obs.started = time.monotonic()
        load_thread.start()
        log(
            f"load and faults for {duration:.0f}s: {plan.fraction:.0%} of storage calls fail ({', '.join(plan.kinds)})"
        )

        control: dict[str, Any] = {}

        def rollout() -> None:
            control["rollout_at"] = obs.at()
            version = publish(artifact, direct_url, HOT)
            mirror.sync()
            log(f"published {HOT} version {version}; rolling it out")
            control["version"] = version
            control["rollout_started"] = obs.at()
            control["rollout"] = run_command(
                [*SKEWSERVE, "rollout", HOT, "--version", str(version),
                 "--config", str(gw_path), "--repo", repo_url, "--load-timeout", "120"], env, logs / "rollout.log")  # fmt: skip
            control["rollout_ended"] = obs.at()
            log(f"rollout exited {control['rollout'][0]}: {control['rollout'][2]}")

        def rollback() -> None:
            control["rollback_started"] = obs.at()
            control["rollback"] = run_command(
                [*SKEWSERVE, "rollback", HOT, "--config", str(gw_path),
                 "--repo", repo_url], env, logs / "rollback.log")  # fmt: skip
            control["rollback_ended"] = obs.at()
            log(f"rollback exited {control['rollback'][0]}: {control['rollback'][2]}")

        rollout_thread = threading.Thread(target=rollout, daemon=True)
        rollback_thread = threading.Thread(target=rollback, daemon=True)
        next_leader, next_triton, turn = args.leader_every, args.triton_every, 0
        promoted_at = rolled_back_at = None
        applied: dict[str, float] = {}  # rollout / rollback -> when every live server served the result
        while obs.at() < duration:
            time.sleep(0.5)
            now = obs.at()
            for replica in replicas:  # a replica that died on its own restarts, as a pod would
                if replica.exited_on_its_own():
                    log(
                        f"controller-{replica.slot} exited on its own ({replica.unexpected_exits[-1]}); restarting"
                    )
                    replica.start()
            if now >= next_leader and watcher.leader_slot is not None:
                next_leader += args.leader_every
                victim = next(r for r in replicas if r.slot == watcher.leader_slot)
                baseline = {
                    s: m.get("skewserve_controller_passes", 0) for s, m in watcher.leader_metrics.items()
                }
                baseline[victim.slot] = 0.0  # its restart counts from zero
                victim.kill()
                obs.leader_kills.append((now, None))
                watcher.pending_leader = (len(obs.leader_kills) - 1, time.monotonic(), baseline)
                log(f"killed the leader, controller-{victim.slot}")
                victim.start()
            if now >= next_triton:
                next_triton += args.triton_every
                name = sorted(servers)[turn % len(servers)]
                turn += 1
                threading.Thread(
                    target=_kill_and_restart, args=(watcher, servers, name, obs), daemon=True
                ).start()
            if now >= duration * 0.25 and not rollout_thread.is_alive() and "rollout_at" not in control:
                rollout_thread.start()
            if now >= duration * 0.6 and promoted_at is not None and "rollback_started" not in control:
                rollback_thread.start()  # a rollback of what the rollout promoted
            state = _served(watcher)
            version = control.get("version")
            if version is not None and promoted_at is None and state.get(HOT) == {version}:
                promoted_at = now
                log(f"{HOT} version {version} promoted")
            if "rollback_started" in control and rolled_back_at is None and state.get(HOT) == {1}:
                rolled_back_at = now
            for step, decided, want in (("rollout", promoted_at, version), ("rollback", rolled_back_at, 1)):
                if decided is not None and step not in applied and _everywhere(watcher, servers, want):
                    applied[step] = now
        log("load ended; waiting for locust's summary")
        load_thread.join(timeout=180)
        proxy.plan = FaultPlan(0.0)
        agreed = {
            "rollout": _agreement(control.get("rollout_started"), promoted_at, applied.get("rollout")),
            "rollback": _agreement(control.get("rollback_started"), rolled_back_at, applied.get("rollback")),
        }
        report(
            args, obs, loadtest.get("result"), work, replicas, proxy, control, agreed, watcher, promoted_at
        )
    finally:
        for stop in reversed(stack):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - stopping the rest matters more
                log(f"while stopping: {exc}")


def _answers(target: str, model: str) -> bool:
    try:
        urllib.request.urlopen(f"{target}/v2/models/{model}/ready", timeout=2).close()
        return True
    except (OSError, urllib.error.URLError):
        return False


def _served(watcher: Watcher) -> dict[str, set[int]]:
    return dict(watcher.last_served)


def _everywhere(watcher: Watcher, servers: dict[str, TritonServer], version: int | None) -> bool:
    """Whether every server (each up, last sampled) has exactly `version` of the hot model READY."""
    seen = [watcher.last_loaded.get(n) for n in servers]
    return all(s is not None and s[1].get(HOT) == [version] for s in seen) and not watcher.down


def _agreement(started: float | None, decided: float | None, everywhere: float | None) -> str:
    if started is None:
        return "not run"
    if decided is None:
        return "the desired state never changed"
    text = f"desired state after {decided - started:.1f}s"
    if everywhere is None:
        return text + ", servers never all on it"
    return text + f", every server on it after {everywhere - started:.1f}s"


def _kill_and_restart(
    watcher: Watcher, servers: dict[str, TritonServer], name: str, obs: Observations
) -> None:
    server = servers[name]
    with watcher.lock:
        watcher.down.add(name)
        obs.triton_kills.append((name, obs.at(), None))
        watcher.pending_servers[name] = (len(obs.triton_kills) - 1, time.monotonic())
        if server.pid is not None:
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop()
        log(f"killed {name}")
        watcher.incarnation[name] += 1
        server.log_path = server.log_dir / f"{REGION}-{name}.{watcher.incarnation[name]}.log"
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on with one server
        obs.events.append(f"{name} did not restart: {exc}")
        log(obs.events[-1])
    finally:
        watcher.down.discard(name)


# -- the report ---------------------------------------------------------------------------------
def _failures_by_second(history: Path) -> dict[str, dict[int, int]]:
    """model -> epoch second -> failures that second (locust's cumulative history, differenced)."""
    out: dict[str, dict[int, int]] = {}
    last: dict[str, int] = {}
    if not history.is_file():
        return out
    with history.open() as f:
        for row in csv.DictReader(f):
            name = row["Name"]
            if name == "Aggregated":
                continue
            model = name.split(" ", 1)[1]
            total = int(float(row["Total Failure Count"]))
            new = total - last.get(model, 0)
            last[model] = total
            if new > 0:
                out.setdefault(model, {})[int(row["Timestamp"])] = new
    return out


def _held_near(obs: Observations, model: str, second: int) -> bool:
    """Whether some live server had a served version of `model` READY at that second (the nearest sample)."""
    for delta in (0, -1, 1, -2, 2):
        if second + delta in obs.served_at:
            return obs.served_at[second + delta][model]
    return False


def report(args: argparse.Namespace, obs: Observations, result: Any, work: Path, replicas: list[ControllerReplica],
           proxy: S3FaultProxy, control: dict[str, Any], agreed: dict[str, str], watcher: Watcher,
           promoted_at: float | None) -> None:  # fmt: skip
    print()
    print(f"chaos: {args.minutes:g} min of skewed locust traffic ({args.users} users) through the gateway onto 2 "
          f"tritonservers, {args.controllers} controller replicas (--leader-lease {args.leader_lease:g}), seed {args.seed}")  # fmt: skip
    faults = {k: v for k, v in proxy.counts.items() if k != "requests"}
    print(f"storage calls through the proxy: {proxy.counts['requests']}, failed: {sum(faults.values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(faults.items()))})")  # fmt: skip
    rows = []
    if result is not None:
        total = result.total
        by_second = _failures_by_second(result.files["history"])
        served_fail = sum(
            n for m, secs in by_second.items() for s, n in secs.items() if _held_near(obs, m, s)
        )
        rows.append(("client requests", f"{total.requests}", ""))
        rows.append(("failed client requests", f"{total.failures}", "goal 0 for served models"))
        rows.append(("  for a model some live server held", f"{served_fail}", "goal 0"))
        for row in result.rows:
            rows.append((f"  {row.name}", f"{row.failures} of {row.requests}", ""))
    else:
        rows.append(("client requests", "locust gave no result", ""))
    rows.append(("unloads of served versions", f"{len(obs.unloads)}", "goal 0"))
    gone = sum(r.log_path.read_text(errors="replace").count("(not in the repository)") for r in replicas)
    rows.append(("  controller 'not in the repository' unloads", f"{gone}", "goal 0"))
    leader_times = [t for _, t in obs.leader_kills if t is not None]
    rows.append(("leader kills", f"{len(obs.leader_kills)}", ""))
    rows.append(("  converged (new leader's first pass)", _spread(leader_times, len(obs.leader_kills)), ""))
    triton_times = [t for _, _, t in obs.triton_kills if t is not None]
    rows.append(("tritonserver kills", f"{len(obs.triton_kills)}", ""))
    rows.append(
        ("  converged (serving every served version)", _spread(triton_times, len(obs.triton_kills)), "")
    )
    rollout = control.get("rollout")
    rows.append(
        ("rollout", "not run" if rollout is None else f"exit {rollout[0]} after {rollout[1]:.1f}s", "")
    )
    rows.append(("  converged", agreed["rollout"], ""))
    rollback = control.get("rollback")
    rows.append(
        (
            "rollback",
            "not run (nothing was promoted)"
            if rollback is None
            else f"exit {rollback[0]} after {rollback[1]:.1f}s",
            "",
        )
    )
    rows.append(("  converged", agreed["rollback"], ""))
    rows.append(("promotions completed", f"{int(promoted_at is not None)} of 1", ""))
    rows.append(("samples with two replicas leading", f"{obs.two_leaders} of {obs.samples}", "goal 0"))
    rows.append(("time with no leader", f"{obs.no_leader_s:.0f}s", ""))
    exits = [f"controller-{r.slot}: {e}" for r in replicas for e in r.unexpected_exits]
    rows.append(("controller exits not caused here", f"{len(exits)}", ""))
    width = max(len(r[0]) for r in rows) + 2
    for name, value, goal in rows:
        print(f"{name:<{width}}{value:<40}{goal}")
    for line in obs.unloads + exits + obs.events:
        print(f"  {line}")
    if result is not None and (work / "locust" / "locust_failures.csv").is_file():
        with (work / "locust" / "locust_failures.csv").open() as f:
            for r in list(csv.DictReader(f))[:5]:
                print(f"  failure x{r['Occurrences']}: {r['Name']}: {r['Error'][:160]}")
    print(f"logs: {work / 'logs'}")


def _spread(times: list[float], count: int) -> str:
    if not count:
        return "none"
    if not times:
        return f"never ({count} pending)"
    missed = count - len(times)
    text = f"median {sorted(times)[len(times) // 2]:.1f}s, max {max(times):.1f}s ({', '.join(f'{t:.0f}' for t in times)})"
    return text + (f"; {missed} not converged when the run ended" if missed else "")


if __name__ == "__main__":
    main()
