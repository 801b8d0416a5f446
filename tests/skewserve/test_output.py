"""What the `skewserve` command prints, run as a real process: verbatim user text, output that fits
a log or CI (no carriage-return redraws), and a key read from standard input."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from skewserve.commands.gateway import KEY_IN_HISTORY_WARNING

SKEWSERVE = [sys.executable, "-m", "skewserve"]
EPOCH_LINE = re.compile(
    r"^train epoch (\d+)/(\d+): loss \d+\.\d{3}, val balanced acc \d\.\d{3}, rank imbalance \d+\.\d{2}$"
)


def run(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `skewserve ARGS` with pipes; stdout/stderr decoded as is (text mode would turn '\r' into '\n')."""
    res = subprocess.run(
        [*SKEWSERVE, *args],
        input=None if stdin is None else stdin.encode(),
        capture_output=True,
        timeout=600,
        env=env,
    )
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(), res.stderr.decode())


def env_without_ci() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CI"}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "data"
    res = run(
        "data",
        "synth",
        "--out",
        str(out),
        "--classes",
        "3",
        "--n-max",
        "100",
        "--features",
        "4",
        "--informative",
        "2",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return out


# -- markup: text from users, files and exceptions prints as is ------------------------------------


@pytest.mark.parametrize("command", [["data", "inspect"], ["train"]])
def test_error_naming_a_path_with_brackets_prints_it_verbatim(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "x[/test]" / "data"
    res = run(*command, "--data", str(missing))
    # Before: rich.errors.MarkupError "closing tag '[/test]'" and a traceback instead of this line.
    assert (res.returncode, res.stdout) == (1, f"error: data directory {missing} does not exist\n"), (
        res.stderr
    )


def test_export_error_with_brackets_prints_verbatim(tmp_path: Path) -> None:
    missing = tmp_path / "art[bold]x[/bold]"
    res = run("export", "--artifact", str(missing), "--repo", str(tmp_path / "repo"), "--name", "m")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0], res.stdout
    assert not (tmp_path / "repo" / "m").exists()


def test_inspect_table_shows_paths_and_class_names_verbatim(tmp_path: Path) -> None:
    data = tmp_path / "d[red]"
    data.mkdir()
    rows = "f0,label\n" + "".join(f"{i}.0,{'[b]a' if i % 3 else 'z[/b]'}\n" for i in range(30))
    for split in ("train", "val"):
        (data / f"{split}.csv").write_text(rows)
    res = run("data", "inspect", "--data", str(data))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{data}: 1 features, 2 classes" in res.stdout
    rows_shown = [re.split(r"[│┃]", line)[1:-1] for line in res.stdout.splitlines() if line[:1] in "│┃"]
    cells = [[c.strip() for c in row] for row in rows_shown]
    assert cells == [["class", "train", "val"], ["[b]a", "20", "20"], ["z[/b]", "10", "10"]], res.stdout


# -- progress that fits a log ------------------------------------------------------------------------


def test_training_without_a_terminal_writes_one_line_per_epoch(tiny_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    res = run(
        "train", "--data", str(tiny_data), "--out", str(out), "--epochs", "3", "--patience", "0",
        "--width", "16", "--nproc", "2", env=env_without_ci(),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "\r" not in res.stdout + res.stderr
    epochs = [EPOCH_LINE.match(line) for line in res.stderr.splitlines()]
    assert [(m[1], m[2]) for m in epochs if m] == [("1", "3"), ("2", "3"), ("3", "3")], res.stderr
    assert (out / "metadata.json").is_file()
    assert res.stdout.splitlines()[-1].startswith("epochs 3 (kept "), res.stdout


def run_on_a_terminal(args: list[str], env: dict[str, str], timeout_s: float = 600.0) -> tuple[int, str]:
    """Run `skewserve ARGS` with stdout and stderr on a pseudo-terminal; (exit code, everything shown)."""
    leader, follower = pty.openpty()
    # A fresh pseudo-terminal is 0x0; give it the size of an ordinary terminal window (rows, cols).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [*SKEWSERVE, *args], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_training_with_ci_set_writes_lines_even_on_a_terminal(tiny_data: Path, tmp_path: Path) -> None:
    args = ["train", "--data", str(tiny_data), "--out", str(tmp_path / "art"), "--epochs", "2"]
    args += ["--patience", "0", "--width", "16"]
    code, shown = run_on_a_terminal(args, env={**os.environ, "CI": "true", "COLUMNS": "200"})
    assert code == 0, shown
    assert "\r\n" in shown  # the terminal is real: it turns each newline into CR LF
    assert "\r" not in shown.replace("\r\n", "\n"), shown  # ...and no bar redraws with a bare CR
    epochs = [EPOCH_LINE.match(line) for line in shown.replace("\r\n", "\n").splitlines()]
    assert [(m[1], m[2]) for m in epochs if m] == [("1", "2"), ("2", "2")], shown


def test_training_on_a_terminal_keeps_the_live_bar(tiny_data: Path, tmp_path: Path) -> None:
    args = ["train", "--data", str(tiny_data), "--out", str(tmp_path / "art"), "--epochs", "2"]
    args += ["--patience", "0", "--width", "16"]
    code, shown = run_on_a_terminal(args, env=env_without_ci())
    assert code == 0, shown
    # A person at a terminal still gets one bar redrawn in place, and no per-epoch lines.
    redraws = shown.replace("\r\n", "\n").split("\r")
    assert len(redraws) > 2 and all(r.startswith("train: ") for r in redraws[1:]), shown
    assert not any(EPOCH_LINE.match(line) for line in shown.replace("\r\n", "\n").splitlines()), shown


def test_export_without_a_terminal_prints_exact_lines(small_artifact: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    res = run(
        "export", "--artifact", str(small_artifact), "--repo", str(repo), "--name", "m", "--tensorrt", "off"
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "\r" not in res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout
    assert re.fullmatch(
        r"parity onnxruntime fp32: max \|Δp\| \S+ \(limit 1e-04\), max \|Δlogit\| \S+, "
        r"arg-max agreement 100\.00% \(limit 99\.9%\) over \d+ rows",
        lines[0],
    ), lines[0]
    assert lines[1] == f"published m version 1 at {repo / 'm' / '1'}"
    assert sorted(p.name for p in (repo / "m" / "1").iterdir()) == [
        ".skewserve-configs",  # the model-level files version 1 was published with
        "batching.py",
        "model.onnx",
        "model.py",
        "model_card.json",
    ]
    # Each rewrite the ONNX optimiser makes is logged at INFO; none of that reaches the person exporting.
    assert "onnxscript" not in res.stderr, res.stderr


# -- hash-key: the key stays out of shell history --------------------------------------------------


def test_hash_key_reads_the_key_from_a_pipe() -> None:
    res = run("gateway", "hash-key", stdin="s3cret key\n")
    digest = hashlib.sha256(b"s3cret key").hexdigest()
    assert (res.returncode, res.stdout, res.stderr) == (0, digest + "\n", "")


def test_hash_key_without_a_trailing_newline_hashes_every_byte() -> None:
    res = run("gateway", "hash-key", stdin="abc")
    assert (res.returncode, res.stdout) == (0, hashlib.sha256(b"abc").hexdigest() + "\n")


def test_hash_key_on_the_command_line_warns_about_shell_history() -> None:
    res = run("gateway", "hash-key", "s3cret")
    assert res.returncode == 0
    assert res.stdout == hashlib.sha256(b"s3cret").hexdigest() + "\n"
    assert res.stderr == f"warning: {KEY_IN_HISTORY_WARNING}\n"


@pytest.mark.parametrize(
    "stdin,message",
    [
        ("", "error: the API key is empty; pipe in a key or type one at the prompt"),
        ("\n", "error: the API key is empty; pipe in a key or type one at the prompt"),
        ("one\ntwo\n", "error: standard input holds 2 lines; give exactly one API key"),
    ],
)
def test_hash_key_refuses_an_empty_or_ambiguous_key(stdin: str, message: str) -> None:
    res = run("gateway", "hash-key", stdin=stdin)
    assert (res.returncode, res.stdout) == (2, message + "\n")
