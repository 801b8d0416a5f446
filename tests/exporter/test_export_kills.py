"""SIGKILL real `skewserve export` processes at seeded random moments and check the repository.

No hook inside the exporter: the kill moments come from a seeded RNG and from what the test sees
on the file system (the staging folder appearing, a model-level temporary appearing). After every
kill the repository must hold only complete versions, earlier versions and the model-level files
must be byte-for-byte intact, and the next export must succeed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.pipeline import export_artifact
from repository.backend import BACKEND_FILE
from repository.disk import model_lock, published_versions
from repository.layout import CARD, STAGING_PREFIX
from repository.model_config import parse
from skewserve.triton_dist import PreparedTriton
from skewserve.triton_process import TritonServer, TritonServerSpec

SEED = 20261130
MODEL = "m"
MODEL_FILES = ("config.pbtxt", "configs/local.pbtxt", "labels.txt")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(model_dir: Path) -> dict[str, str]:
    """sha256 of every file of every visible version and of the model-level files."""
    files = [model_dir / rel for rel in MODEL_FILES]
    for v in published_versions(model_dir):
        files += [p for p in (model_dir / str(v)).rglob("*") if p.is_file()]
    return {str(p.relative_to(model_dir)): _sha(p) for p in files}


def _model_level_temporaries(model_dir: Path) -> list[Path]:
    rels = (*MODEL_FILES, BACKEND_FILE)  # a version not served rewrites only the backend record
    return [p for rel in rels for p in (model_dir / rel).parent.glob(f".{Path(rel).name}.tmp-*")]


def _check_repository(model_dir: Path, before: dict[str, str], classes: list[str]) -> None:
    """Every visible version is complete, earlier files unchanged, model-level files whole and parseable."""
    visible = sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit())
    assert visible == published_versions(model_dir), f"a version folder without its {CARD}: {visible}"
    for v in visible:
        card = json.loads((model_dir / str(v) / CARD).read_text())
        for name, sha in card["export"]["files"].items():
            assert _sha(model_dir / str(v) / name) == sha, f"version {v} {name} differs from its card"
    assert parse((model_dir / "config.pbtxt").read_text()).name == MODEL
    assert parse((model_dir / "configs/local.pbtxt").read_text()).backend == "python"
    assert (model_dir / "labels.txt").read_text().splitlines() == classes
    now = _snapshot(model_dir)
    # Same artifact and options every time: the model-level files and earlier versions never change.
    assert {k: now.get(k) for k in before} == before


def _spawn_export(artifact: Path, repo: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "skewserve", "export", "--artifact", str(artifact), "--repo", str(repo)]
    with open(log, "ab") as out:
        return subprocess.Popen([*cmd, "--name", MODEL, "--tensorrt", "off"], stdout=out, stderr=out)


def _kill(proc: subprocess.Popen[bytes]) -> bool:
    """SIGKILL and reap (a zombie's pid still answers kill(pid, 0)); True if it was still running."""
    running = proc.poll() is None
    if running:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return running and proc.returncode == -signal.SIGKILL


def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float = 60) -> bool:
    """Poll until `predicate` holds (True) or the export exits first (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(0.002)
    raise AssertionError(f"nothing observed within {timeout_s}s")


def _step_until(
    predicate: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60
) -> bool:
    """Run the export in short slices (SIGCONT, SIGSTOP) and check `predicate` while it is stopped.

    A stopped process cannot rename its temporary away between the check and the kill, and a stop
    requested during the temporary's fsync takes effect before the rename that follows it: the few
    hundred microseconds a one-file rewrite lasts are caught, which polling a running process misses.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):  # it exited before the stop: let Popen see the exit code
            proc.returncode = os.waitstatus_to_exitcode(status)
            return predicate()
        if predicate():
            return True  # left stopped: the caller's SIGKILL lands on this moment
        proc.send_signal(signal.SIGCONT)
        _one_slice(proc.pid)
    raise AssertionError(f"nothing observed within {timeout_s}s; {_where(proc.pid, log)}")


def _where(pid: int, log: Path) -> str:
    """What a stepped export was doing when nothing came: its state, kernel wait and log's end."""
    proc_dir = Path(f"/proc/{pid}")
    try:
        state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = (proc_dir / "wchan").read_text()
    except OSError as exc:
        state, wchan = "gone", str(exc)
    return f"export state {state}, waiting in {wchan!r}, its log ends: {log.read_text()[-2000:]!r}"


def _one_slice(pid: int, most_s: float = 0.005) -> None:
    """Let a continued export run until it has made one more read or write call (a temporary's
    write is one: the stop that follows lands before its rename), or for `most_s` while it computes
    or waits. Stopped again at once, a starved export never ran between the two signals on a loaded
    machine (a clean-clone run saw nothing in 60 s)."""
    calls = _io_calls(pid)
    until = time.monotonic() + most_s
    while _io_calls(pid) == calls and time.monotonic() < until:
        os.sched_yield()


def _io_calls(pid: int) -> int:
    """The process's read and write calls so far (/proc/<pid>/io), -1 once it is gone."""
    try:
        fields = dict(line.split(": ", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["syscr"]) + int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return -1


def _staging_dirs(model_dir: Path) -> list[Path]:
    return list(model_dir.glob(f"{STAGING_PREFIX}*"))


@pytest.mark.slow
def test_sigkilled_exports_never_expose_a_partial_version(
    small_artifact: Path, tmp_path: Path, prepared_triton: PreparedTriton
) -> None:
    rng = random.Random(SEED)
    repo = tmp_path / "repo"
    model_dir = repo / MODEL
    log = tmp_path / "exports.log"
    export_artifact(small_artifact, repo, MODEL, tensorrt="off")
    classes = json.loads((model_dir / "1" / CARD).read_text())["artifact"]["metadata"]["classes"]
    killed: list[str] = []

    def after_kill(moment: str, proc: subprocess.Popen[bytes]) -> None:
        before = _snapshot(model_dir)
        if _kill(proc):
            killed.append(moment)
        _check_repository(model_dir, before, classes)

    # 1. Seeded random moments after start: imports, ONNX export, parity, publish.
    for _ in range(3):
        proc = _spawn_export(small_artifact, repo, log)
        time.sleep(rng.uniform(0.5, 5.0))
        after_kill("random", proc)
        export_artifact(small_artifact, repo, MODEL, tensorrt="off")  # the next export succeeds

    # 2. Seeded delays after the staging folder appears: partial staging, then the publish itself.
    for _ in range(5):
        proc = _spawn_export(small_artifact, repo, log)
        _wait_for(lambda: bool(_staging_dirs(model_dir)), proc)
        time.sleep(rng.uniform(0.0, 0.8))
        after_kill("staged", proc)
        assert export_artifact(small_artifact, repo, MODEL, tensorrt="off").published.version == max(
            published_versions(model_dir)
        )
        assert not _staging_dirs(model_dir), "stale staging folders of killed exports are removed"

    # 3. While the model-level files are rewritten. The test holds the publish lock until the export
    # has staged a complete version, then steps the export in stopped slices and kills when a
    # model-level temporary is seen: a temporary left behind proves the kill landed between its write
    # and its rename.
    torn_moments = 0
    for _ in range(4):
        proc = _spawn_export(small_artifact, repo, log)
        with model_lock(model_dir):
            card = f"{STAGING_PREFIX}*-{proc.pid}/{CARD}"  # this export's own staging folder, complete
            _wait_for(lambda card=card: any(model_dir.glob(card)), proc)  # type: ignore[misc]
            before = _snapshot(model_dir)
        seen = _step_until(lambda: bool(_model_level_temporaries(model_dir)), proc, log)
        was_running = _kill(proc)
        if seen and was_running:
            killed.append("model-files")
            torn_moments += bool(_model_level_temporaries(model_dir))
        _check_repository(model_dir, before, classes)
        if torn_moments:
            break
    assert torn_moments >= 1, "no kill landed while a model-level file was being rewritten"

    # Readers ignore what the kills left: a real Triton loads what the desired state serves (the
    # first version: publishing never changes that), and the state names only complete versions.
    leftovers = _staging_dirs(model_dir) + _model_level_temporaries(model_dir)
    assert leftovers, "the last kill left temporaries for Triton to ignore"
    (tmp_path / "logs").mkdir()
    server = TritonServer(TritonServerSpec(repository=repo, name="kills"), tmp_path / "logs", prepared_triton)
    with server:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(server.http_address)
        from repository.disk_store import DiskStateStore

        state = DiskStateStore(repo).current(MODEL)
        assert state is not None and set(state.versions) <= set(published_versions(model_dir))
        assert client.is_model_ready(MODEL, str(state.served[-1]))

    final = export_artifact(small_artifact, repo, MODEL, tensorrt="off").published.version
    assert final == max(published_versions(model_dir)) and not _staging_dirs(model_dir)
    assert not _model_level_temporaries(model_dir), "the next publish removes stale temporaries"
    assert len(killed) >= 8, f"only {len(killed)} exports were still running when killed: {killed}"
