"""The gateway folder shows its architecture: every module in a sub-package by its job, and the
imports between them point one way, down the layers below (read from the source: every import
counts, those under TYPE_CHECKING and inside functions too, since a type-only or deferred import is
still a dependency, and moving it into a function only hides a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
PACKAGES = {"fronts", "pipeline", "upstream", "fleet", "state", "operations"}
# The process and the objects every package shares: the config, the errors, the headers that may
# reach Triton, stopping background tasks, a connection's one timer (the fronts' connections and the
# upstream pool's), the Gateway itself, and what runs the process (listeners, reload, workers), and
# which build of the hot path runs (compiled or pure).
TOP_LEVEL = {
    "__init__",
    "__main__",
    "compiled_build",
    "config",
    "connection_timer",
    "core",
    "errors",
    "forward_headers",
    "reload",
    "server",
    "supervisor",
    "task_stop",
}
# Lowest first: a module may import from its own layer's package (or module) and from layers below,
# never from a layer above. Within a layer, the packages or modules named do not import each other.
LAYERS: list[set[str]] = [
    {"errors", "task_stop", "compiled_build", "connection_timer"},
    {"forward_headers"},
    {"config"},
    {"operations", "upstream"},  # metrics, logs, step costs; the calls to Triton
    {"state"},  # keys, limits, cache, bytes and streams held
    {"fleet"},  # servers, routing, health, the dispatcher, canary traffic
    {"core"},  # the Gateway
    {"pipeline"},  # the request's steps, admission first
    {"fronts"},  # the wire in and out
    {"reload"},  # the process: config reload, workers, the listeners, the entry point
    {"supervisor"},
    {"server"},
    {"__main__"},
]


def _module(path: Path) -> str:
    return ".".join(path.relative_to(GATEWAY.parent).with_suffix("").parts).removesuffix(".__init__")


def _unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: `gateway.fleet.router` -> `fleet`."""
    return module.split(".")[1] if module != "gateway" else "__init__"


def _imports(root: Path = GATEWAY) -> dict[str, set[str]]:
    """Module -> the gateway modules it imports, wherever the import statement stands."""
    graph = {}
    for path in root.rglob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gateway"):
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("gateway")}
        graph[".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")] = deps
    # `from gateway.fleet import router` names the module; a package's own `__init__` is no edge.
    return {
        m: {d for d in deps if d in graph and d != m and d != m.rpartition(".")[0] and d != "gateway"}
        for m, deps in graph.items()
    }


def _rank(module: str) -> int:
    unit = _unit(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    found: list[str] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a layer above, or sideways between two packages of one layer."""
    wrong = []
    for module, deps in sorted(graph.items()):
        if _unit(module) == "__init__":
            continue
        for dep in sorted(deps):
            if _unit(dep) == _unit(module):
                continue
            if _rank(dep) >= _rank(module):
                wrong.append(f"{module} -> {dep}")
    return wrong


def test_every_module_sits_in_a_package_named_for_its_job() -> None:
    stray = [p.name for p in GATEWAY.glob("*.py") if p.stem not in TOP_LEVEL]
    assert not stray, f"modules outside the sub-packages: {stray}"
    assert {p.name for p in GATEWAY.iterdir() if (p / "__init__.py").exists()} == PACKAGES
    placed = {unit for layer in LAYERS for unit in layer}
    assert placed == (PACKAGES | TOP_LEVEL) - {"__init__"}, "every package and top-level module has a layer"


def test_no_import_cycles() -> None:
    """Type-only and function-level imports included: `fleet/shadow.py` and `traffic.py` once
    named each other's types."""
    cycles = import_cycles(_imports())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_point_down_the_layers() -> None:
    """The dispatcher is the engine under `Gateway` (fleet/, not a pipeline step), the modules that
    need `Gateway` sit above it (the reload beside server.py, the ops listener's app with the fronts),
    the step costs are measured in operations/, and the config reads the header rules below it."""
    wrong = upward_imports(_imports())
    assert not wrong, "imports from a layer above (see LAYERS):\n" + "\n".join(wrong)
