"""The whole source's imports point one way: no module circle anywhere, no arrow up between packages.

Read from the source: every import counts, those under TYPE_CHECKING and inside functions too (a
deferred or type-only import is still a dependency, and moving an import into a function only hides
a circle). The gateway's own layers inside its package are checked by tests/gateway/test_layout.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import packages of lower layers, never of its own layer or above.
LAYERS: list[set[str]] = [
    {"repository", "training", "gateway"},  # the model repository; training; the serving gateway
    {"exporter", "loadtests"},  # artifact -> repository version; load that trains nothing
    {"controller"},  # reconciles the repository's desired state onto the servers the gateway finds
    {"skewserve"},  # the command line and the local stack
]
PACKAGES = set().union(*LAYERS)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a name imported from a package counts as the
    submodule when there is one; a module's own parent packages are no edge)."""
    paths = {_module_name(p): p for pkg in sorted(PACKAGES) for p in (ROOT / pkg).rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {d for d in map(known, names) if d is not None}
        graph[module] = {d for d in deps if d != module and not module.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer(module: str) -> int:
    package = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_every_package_is_placed_in_a_layer() -> None:
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks", "examples"}
    assert on_disk <= PACKAGES, f"packages in no layer: {sorted(on_disk - PACKAGES)}"


def test_no_import_circle_in_the_whole_source() -> None:
    assert _cycles(_graph()) == []


def test_no_arrow_up_or_across_between_packages() -> None:
    wrong = sorted(
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        for dep in deps
        if dep.split(".")[0] != module.split(".")[0] and _layer(dep) >= _layer(module)
    )
    assert wrong == []


def test_the_checks_see_a_circle_and_an_arrow_up() -> None:
    """The rules can fail: a made-up circle and an upward arrow are both found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("repository.publish") < _layer("controller.reconcile")
