"""The documents a newcomer reads: the README stays short, every link resolves, every help text
that points to a section names one that exists, and every command a document shows runs as written.

Which documented commands run for real, and which are only checked:
- Run for real, in a fresh folder, in the order the document gives them: the commands of the README
  and of the examples' READMEs that are cheap and need nothing running (`skewserve data
  synth|digits|topics|inspect`, and any `... --help`). Each must exit 0.
- Checked, not run: everything else (`make demo`, `make test`, training, export, `skewserve up`, a
  rollout, anything that needs a running stack, a GPU, Docker or a cluster). A `skewserve` command
  must be a real command or sub-command and every `--flag` it passes must be one of that command's
  options (read from its `--help`); a `make` target must exist in the Makefile; a `python FILE` must
  exist and its flags appear in its `--help`; a Python here-document must compile; a path into the
  project's own folders (`deploy/...`, `examples/...`, ...) must exist; any other program must be one
  of the tools the documents are allowed to name (`KNOWN_TOOLS`).
Commands come from the fenced ```bash blocks of README.md, docs/*.md, deploy/README.md and
examples/**/README.md; continuation lines are joined, comments dropped, and `$(...)` / `<(...)`
checked as commands of their own.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 400


def _documents() -> list[Path]:
    return [
        README,
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "deploy" / "README.md",
        *sorted((ROOT / "examples").glob("**/README.md")),
    ]


DOCUMENTS = _documents()
# Where commands run for real (the rest of DOCUMENTS: checked only).
RUNNABLE_DOCUMENTS = [README, *sorted((ROOT / "examples").glob("**/README.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- headings and links ----------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The document's lines outside fenced code blocks (blanked inside, so numbers still match)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: inline markup dropped, lower case, punctuation removed,
    spaces to hyphens (github-slugger)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def headings(path: Path) -> tuple[tuple[str, str], ...]:
    """(heading text, anchor) of every heading, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = []
    for line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.append((m.group(1), slug if n == 0 else f"{slug}-{n}"))
    return tuple(found)


def anchors(path: Path) -> set[str]:
    return {anchor for _, anchor in headings(path)}


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link and image outside code."""
    found = []
    for number, line in enumerate(prose_lines(path.read_text()), 1):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
    return found


def resolve(doc: Path, target: str) -> str | None:
    """None when `target` (relative to `doc`) names an existing file and, if any, heading; else why not."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    path = (doc.parent / path_part).resolve() if path_part else doc
    if not path.exists():
        return f"{path_part} does not exist"
    if ROOT not in path.parents and path != ROOT:
        return f"{path_part} is outside the project"
    if anchor:
        if path.suffix != ".md":
            return f"#{anchor} on a file that is not markdown"
        if anchor not in anchors(path):
            return f"{rel(path)} has no heading with anchor #{anchor} (it has: {sorted(anchors(path))})"
    return None


def test_the_readme_fits_the_first_hour() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md is {len(lines)} lines; move detail to docs/"
    # CI and users rely on the two commands being the README's first lines.
    head = "\n".join(lines[:6])
    assert "make demo" in head and "make test" in head, head


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for _, target in links(README)
        if target.startswith("docs/")
    }
    pages = set((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    assert {p.resolve() for p in pages} <= linked, sorted(rel(p) for p in pages if p.resolve() not in linked)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=rel)
def test_every_link_resolves(doc: Path) -> None:
    broken = [f"{rel(doc)}:{n}: {target}: {why}" for n, target in links(doc) if (why := resolve(doc, target))]
    assert not broken, "\n".join(broken)


def test_the_slugs_are_githubs() -> None:
    # github-slugger's own cases, and the shapes our headings take
    assert github_slug("Walkthrough (what `make demo` does, as commands)") == (
        "walkthrough-what-make-demo-does-as-commands"
    )
    assert github_slug("On a GPU: CIFAR-10-LT (ratio 100)") == "on-a-gpu-cifar-10-lt-ratio-100"
    assert github_slug("Retries, hedging, deadlines") == "retries-hedging-deadlines"
    assert github_slug("A model's backend does not flip") == "a-models-backend-does-not-flip"
    assert github_slug("gRPC data plane") == "grpc-data-plane"


# --- references from the code to the documents --------------------------------------------------

SOURCE_DIRS = ["skewserve", "training", "exporter", "controller", "repository", "gateway", "loadtests"]
# `docs/<page>.md#<anchor>` / `README.md#<anchor>`, and the older `README, 'Heading'` form.
DOC_LINK = re.compile(r"(?<![\w/.-])((?:docs/[\w-]+|README)\.md(?:#[\w-]+)?)")
README_SECTION = re.compile(r"README(?:\.md)?,\s*(?:'([^']+)'|\"([^\"]+)\")")


def help_references() -> list[tuple[str, str]]:
    """(file:line, reference) of every pointer from the source into README.md or docs/."""
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).glob("**/*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                where = f"{rel(path)}:{number}"
                found += [(where, m.group(1)) for m in DOC_LINK.finditer(line)]
                found += [
                    (where, f"README, '{m.group(1) or m.group(2)}'") for m in README_SECTION.finditer(line)
                ]
    return found


def test_help_texts_point_to_real_sections() -> None:
    """A help text or message that sends a user to a section names one that exists: a link
    `docs/<page>.md#<anchor>` that resolves (preferred), or a heading of the README by its words."""
    broken = []
    readme_headings = {text.lower() for text, _ in headings(README)}
    for where, ref in help_references():
        if ref.startswith("README, "):
            title = ref.split(", ", 1)[1].strip("'")
            if title.lower() not in readme_headings:
                broken.append(
                    f"{where}: {ref}: README.md has no such heading; point to docs/<page>.md#<anchor>"
                )
        elif why := resolve(README, ref):
            broken.append(f"{where}: {ref}: {why}")
    assert not broken, "\n".join(broken)


# --- documented commands ----------------------------------------------------------------------------

KNOWN_TOOLS = {
    "cat", "curl", "docker", "echo", "export", "kubectl", "openssl", "pip", "printf", "source",
}  # fmt: skip
SHELL_WORDS = {"do", "done", "then", "fi", "if"}
# Documented `skewserve` commands cheap enough to run for real (nothing running, seconds each).
RUN_FOR_REAL = {("data", "synth"), ("data", "digits"), ("data", "topics"), ("data", "inspect")}
# Top-level folders of the project: a documented path into one of them must exist.
PROJECT_DIRS = {
    "benchmarks", "controller", "deploy", "docs", "examples", "exporter", "gateway", "loadtests",
    "repository", "scripts", "skewserve", "tests", "training",
}  # fmt: skip


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int  # of the block's line the command starts on
    words: tuple[str, ...]
    heredoc: str | None = None  # the here-document's body, when the command reads one

    def __str__(self) -> str:
        return f"{rel(self.doc)}:{self.line}: {shlex.join(self.words)}"


def _split_substitutions(line: str) -> tuple[str, list[str]]:
    """`$(...)` and `<(...)` (innermost first) taken out as commands of their own."""
    inner: list[str] = []
    pattern = re.compile(r"[$<]\(([^()]*)\)")
    while m := pattern.search(line):
        inner.append(m.group(1))
        line = line[: m.start()] + "SUBSTITUTED" + line[m.end() :]
    return line, inner


def _simple_commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in {"|", "||", "&&", ";", "&"}:
            commands.append([])
        elif token in {"<", ">", ">>", "2>", "<<", "2>&1", ">&"}:
            i += 1  # the redirection's target
        elif re.fullmatch(r"[<>|&;()]+", token):
            pass
        else:
            commands[-1].append(token)
        i += 1
    result = []
    for words in commands:
        if words[:1] == ["for"]:
            continue  # `for NAME in WORDS`: the loop's head; its body's commands follow `do`
        while words and (words[0] in SHELL_WORDS or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0])):
            words = words[1:]  # `do`, and VAR=value set for the one command
        if words:
            result.append(words)
    return result


def commands_of(doc: Path) -> list[Command]:
    """Every command of the document's ```bash blocks, in order."""
    lines = doc.read_text().splitlines()
    found: list[Command] = []
    i = 0
    while i < len(lines):
        if not re.match(r"^\s*```(bash|sh|shell)\s*$", lines[i]):
            i += 1
            continue
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            start = i + 1
            logical = lines[i]
            while logical.endswith("\\") and i + 1 < len(lines):
                i += 1
                logical = logical[:-1] + " " + lines[i].strip()
            heredoc = None
            if m := re.search(r"<<-?\s*'?\"?(\w+)'?\"?", logical):
                body = []
                while i + 1 < len(lines) and lines[i + 1].strip() != m.group(1):
                    i += 1
                    body.append(lines[i])
                i += 1  # the delimiter
                heredoc = "\n".join(body) + "\n"
                logical = logical[: m.start()]
            outer, inner = _split_substitutions(logical)
            for text in [outer, *inner]:
                for words in _simple_commands(text):
                    found.append(Command(doc, start, tuple(words), heredoc if text is outer else None))
            i += 1
        i += 1
    return found


ALL_COMMANDS = [c for doc in DOCUMENTS for c in commands_of(doc)]


@functools.cache
def skewserve_prefix() -> tuple[str, ...]:
    """How to run the `skewserve` command of this checkout: its entry point as pyproject.toml
    declares it (so a moved module needs no reinstall to be tested)."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["skewserve"]
    module, _, attr = target.partition(":")
    code = f"import sys; sys.argv[0] = 'skewserve'; from {module} import {attr} as main; main()"
    return (sys.executable, "-c", code)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


@functools.cache
def help_of(program: tuple[str, ...]) -> str:
    res = run([*program, "--help"], ROOT)
    assert res.returncode == 0, f"{shlex.join(program)} --help failed:\n{res.stdout}{res.stderr}"
    return res.stdout


def options_in(help_text: str) -> set[str]:
    """The `--flags` a help text lists as options (not ones its descriptions mention)."""
    found: set[str] = set()
    for line in help_text.splitlines():
        if re.match(r"^\s{1,6}(-\w,\s*)?--", line):
            column = line.strip().split("  ", 1)[0]  # the option's own column, not its description
            found |= set(re.findall(r"(?<![\w-])--[a-z0-9][\w-]*", column))
    return found


def subcommands_in(help_text: str) -> set[str]:
    section = help_text.partition("\nCommands:")[2]
    return {m.group(1) for m in re.finditer(r"^\s{1,4}([a-z][\w-]*)\s", section, re.M)}


def skewserve_path(args: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """The (sub)command the arguments name, and the problems found on the way."""
    path: tuple[str, ...] = ()
    for arg in args:
        if arg.startswith("-"):
            break
        commands = subcommands_in(help_of((*skewserve_prefix(), *path)))
        if not commands:
            break
        if arg not in commands:
            return path, [
                f"`skewserve {' '.join((*path, arg))}` is not a command (there are: {sorted(commands)})"
            ]
        path = (*path, arg)
    return path, []


def flags_of(words: tuple[str, ...]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def project_paths(words: tuple[str, ...]) -> list[str]:
    words = tuple(re.sub(r"\.py:\w+$", ".py", w) for w in words)  # path/to/file.py:FACTORY
    return [
        w
        for w in words
        if "/" in w
        and not re.search(r"[$*<>{}]|://", w)
        and w.split("/", 1)[0] in PROJECT_DIRS
        and not w.startswith("-")
    ]


@functools.cache
def make_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^([\w.-]+(?:\s+[\w.-]+)*)\s*:(?![=])", line):
            targets |= set(m.group(1).split())
    return targets


def problems(command: Command) -> list[str]:
    """Why the command would not run as written (empty: it would, as far as can be told unrun)."""
    words = command.words
    program = os.path.basename(words[0])
    found: list[str] = []
    if program == "skewserve":
        path, found = skewserve_path(words[1:])
        if not found:
            options = options_in(help_of((*skewserve_prefix(), *path)))
            found += [
                f"`skewserve {' '.join(path)}` has no option {flag}"
                for flag in flags_of(words)
                if flag not in options
            ]
        paths = project_paths(words)
    elif program == "make":
        found += [
            f"the Makefile has no target {w}" for w in words[1:] if "=" not in w and w not in make_targets()
        ]
        paths = []
    elif program in {"python", "python3"}:
        rest = list(words[1:])
        if rest[:1] == ["-"]:
            if command.heredoc is None:
                found.append("`python -` without a here-document")
            else:
                try:
                    ast.parse(command.heredoc)
                except SyntaxError as exc:
                    found.append(f"its Python does not compile: {exc}")
        elif rest[:1] == ["-c"]:
            try:
                ast.parse(rest[1])
            except SyntaxError as exc:
                found.append(f"its Python does not compile: {exc}")
        elif rest[:1] == ["-m"]:
            pass  # a module of the standard library or an installed tool (json.tool, venv)
        elif rest:
            script = ROOT / rest[0]
            if not script.is_file():
                found.append(f"{rest[0]} does not exist")
            else:
                options = options_in(help_of((sys.executable, str(script))))
                found += [
                    f"{rest[0]} has no option {flag}"
                    for flag in flags_of(tuple(rest[1:]))
                    if flag not in options
                ]
        paths = project_paths(words)
    elif program in KNOWN_TOOLS:
        # another tool's own arguments are its business; the project files it is given must exist
        paths = [v for k, v in zip(words, words[1:], strict=False) if k in {"-f", "-k", "--file"}]
        paths = [p for p in paths if not re.search(r"[$*]|://", p)]
    else:
        return [f"{program} is neither a project command nor one of KNOWN_TOOLS ({sorted(KNOWN_TOOLS)})"]
    found += [f"{p} does not exist" for p in paths if not (ROOT / p).exists()]
    return found


def test_the_commands_are_found() -> None:
    # Guards the extraction: if it found nothing, the parametrised test below would prove nothing.
    shown = {" ".join(c.words[:3]) for c in ALL_COMMANDS}
    assert {
        "make demo",
        "make test",
        "skewserve data synth",
        "skewserve train --data",
        "skewserve up --config",
    } <= shown
    assert any(c.doc.parent.parent == ROOT / "examples" for c in ALL_COMMANDS)
    assert any(c.heredoc for c in ALL_COMMANDS if c.words[:2] == ("python", "-"))


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_every_documented_command_is_valid_as_written(command: Command) -> None:
    assert not problems(command), f"{command}\n" + "\n".join(problems(command))


def test_a_wrong_flag_or_command_is_caught() -> None:
    # The checker itself: what it must refuse.
    fake = Path(README)
    assert problems(Command(fake, 1, ("skewserve", "up", "--repo", "x"))) == []
    assert problems(Command(fake, 1, ("skewserve", "up", "--repos", "x"))) == [
        "`skewserve up` has no option --repos"
    ]
    assert problems(Command(fake, 1, ("skewserve", "upp")))[0].startswith("`skewserve upp` is not a command")
    assert problems(Command(fake, 1, ("skewserve", "rollout", "m", "--config", "examples/stack.yaml"))) == [
        "examples/stack.yaml does not exist"
    ]
    assert problems(Command(fake, 1, ("make", "demoo"))) == ["the Makefile has no target demoo"]
    assert problems(Command(fake, 1, ("python", "-"), "print(")) != []


def _runs_for_real(command: Command) -> bool:
    if command.words[0] != "skewserve":
        return False
    path, _ = skewserve_path(command.words[1:])
    return path in RUN_FOR_REAL or "--help" in command.words


@pytest.mark.parametrize("doc", RUNNABLE_DOCUMENTS, ids=rel)
def test_the_cheap_commands_run_as_written(doc: Path, tmp_path: Path) -> None:
    """The document's cheap commands, run in its order in a fresh folder (with the project's input
    folders beside them, as in a checkout), each exiting 0."""
    for name in PROJECT_DIRS:
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    ran = []
    for command in commands_of(doc):
        if not _runs_for_real(command):
            continue
        res = run([*skewserve_prefix(), *command.words[1:]], tmp_path)
        assert res.returncode == 0, f"{command}\n{res.stdout}{res.stderr}"
        ran.append(command)
    if doc == README:
        assert {c.words[1:3] for c in ran} >= {("data", "synth"), ("data", "inspect"), ("data", "digits")}


def top_level_commands() -> list[str]:
    return sorted(subcommands_in(help_of(skewserve_prefix())))


def test_every_commands_help_links_its_documentation() -> None:
    """`skewserve <command> --help` names the page that explains it, by a link that resolves
    (`docs/<page>.md#<anchor>`, or `README.md#<anchor>` for the walkthrough's commands)."""
    missing = []
    for name in top_level_commands():
        text = help_of((*skewserve_prefix(), name))
        refs = DOC_LINK.findall(text)
        if not refs:
            missing.append(f"skewserve {name} --help links no page of docs/ or README.md")
        missing += [f"skewserve {name} --help: {ref}: {why}" for ref in refs if (why := resolve(README, ref))]
    assert not missing, "\n".join(missing)
