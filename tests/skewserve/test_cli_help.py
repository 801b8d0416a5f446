"""`--help` of every `skewserve` command and sub-command, found from the app itself, not a hand list.

Help goes through the same formatter users get from the locked typer/rich (which reads Rich markup
when the app enables it): each command must exit 0, show its own first help line, and show every
option's help as written, so `train/val[/test]` can neither crash the help nor lose characters.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import typer.main

from skewserve.commands.main import app

SKEWSERVE = [sys.executable, "-m", "skewserve"]


def walk(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = [(path, command)]
    # Duck-typed: typer may build its commands on a click it vendors, not on the `click` package.
    if hasattr(command, "commands"):
        for name, sub in sorted(command.commands.items()):
            found += walk(sub, (*path, name))
    return found


COMMANDS = walk(typer.main.get_command(app))


def squash(text: str) -> str:
    """Whitespace-insensitive form: help output wraps lines wherever the width falls (also after a '-')."""
    return re.sub(r"\s+", " ", re.sub(r"-\n\s+", "-", text)).strip()


def test_the_walk_finds_every_command_of_the_product() -> None:
    # Guards the discovery itself: if it found nothing, the parametrised test below would prove nothing.
    assert {" ".join(path) for path, _ in COMMANDS} >= {
        "",
        "data",
        "data synth",
        "data inspect",
        "train",
        "export",
        "rollout",
        "triton",
        "triton up",
        "gateway",
        "gateway hash-key",
        "up",
        "loadtest",
        "demo",
    }


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "skewserve" for p, _ in COMMANDS])
def test_help_shows_the_commands_own_text(path: tuple[str, ...], command: Any) -> None:
    res = subprocess.run([*SKEWSERVE, *path, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    out = squash(res.stdout)
    usage = f"Usage: python -m skewserve {' '.join(path)}".rstrip()
    assert out.startswith(usage + " "), res.stdout
    first_line = (command.help or "").strip().splitlines()[0]
    assert first_line, f"`skewserve {' '.join(path)}` has no help text"
    assert squash(first_line) in out, res.stdout
    for param in command.params:
        help_text = getattr(param, "help", None)
        if help_text:
            assert squash(help_text) in out, f"help of {param.name} is not shown verbatim:\n{res.stdout}"


def test_help_with_brackets_prints_verbatim() -> None:
    res = subprocess.run([*SKEWSERVE, "train", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "Directory with train/val[/test] .parquet or .csv." in squash(res.stdout)
