"""The gateway folder shows its architecture: every module in a sub-package by its job, and no
import cycle between modules (read from the source, as Python would import it)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
PACKAGES = {"fronts", "pipeline", "upstream", "fleet", "state", "operations"}
# The process and the objects every package shares: the config, the errors, the Gateway itself.
TOP_LEVEL = {"__init__", "__main__", "config", "core", "errors", "server", "supervisor"}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(GATEWAY.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """Module -> the gateway modules it imports when it is imported (TYPE_CHECKING and
    function-level imports do not run at import time)."""
    graph = {}
    for path in GATEWAY.rglob("*.py"):
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gateway"):
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("gateway")}
        graph[_module(path)] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_every_module_sits_in_a_package_named_for_its_job() -> None:
    stray = [p.name for p in GATEWAY.glob("*.py") if p.stem not in TOP_LEVEL]
    assert not stray, f"modules outside the sub-packages: {stray}"
    assert {p.name for p in GATEWAY.iterdir() if (p / "__init__.py").exists()} == PACKAGES


def test_no_import_cycles() -> None:
    graph = _imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
