"""Which build of the gateway's hot path this process runs: compiled (mypyc) or pure Python.

`make setup` compiles the modules in `COMPILED` with mypyc (scripts/compile_gateway.py): each gets
an extension module next to its source, which Python's importer prefers to the `.py`, and the build
writes `gateway/compiled.json` with the hash of every gateway source as it was compiled (the
interpreted ones too: compiled code checks the types it saw in them). The `.py` files stay the
reference and the fallback:

- `SKEWSERVE_GATEWAY_BUILD=pure` runs the sources even where the extensions exist (the tests keep
  that build honest; an operator can switch to it without rebuilding);
- a build that no longer matches would run old code or mix two builds, so when any source differs
  from its recorded hash, or an extension module is missing, the whole build is set aside
  (compiled modules call each other directly: all or nothing) with a warning naming the file and
  `make setup`.

`install()` runs once, from `gateway/__init__.py`, before any compiled module can be imported.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST = PACKAGE_DIR / "compiled.json"
ENV = "SKEWSERVE_GATEWAY_BUILD"
BUILDS = ("compiled", "pure")

# The request path of both fronts, measured module by module (benchmarks/gateway_bench.py `steps`,
# docs/benchmarks.md): the pipeline's steps, the JSON body reader (orjson's read of a small header,
# its checks, the keying and the deadline's splice) and its depth bound, the HTTP exchange, cache
# keying, routing and the balancer, the dispatcher's retry/hedge bookkeeping, admission's limits and
# keys, metrics recording and its tallies, and the gRPC worker's own path (the bridge, the front and
# its ModelInfer wire, the conversion to Triton's HTTP port), the Gateway every step asks (core.py;
# a test's stand-in for it must be a real Gateway), and the HTTP connection: its protocol (a
# subclass of uvicorn's interpreted class, which compiles when what it reads of uvicorn is read as
# uvicorn sets it), eager start and request ids. Interpreted: the errors (their subclasses override
# class attributes, which compiled classes do not allow; and a class built on a C extension's class,
# grpc's Cython AbortError for one, compiles but crashes when used), FastAPI's routes (it reads their
# signatures), the exact JSON reader (exact_json.py: a large header's walk runs in a worker thread
# and gives the event loop the GIL at the interpreter's switch interval, which compiled code never
# does), and what only runs at start-up.
COMPILED: tuple[str, ...] = (
    "gateway/connection_timer.py",
    "gateway/core.py",
    "gateway/forward_headers.py",
    "gateway/fronts/eager_start.py",
    "gateway/fronts/grpc_bridge.py",
    "gateway/fronts/grpc_front.py",
    "gateway/fronts/grpc_infer.py",
    "gateway/fronts/http_infer.py",
    "gateway/fronts/http_protocol.py",
    "gateway/fronts/infer_body.py",
    "gateway/fronts/infer_exchange.py",
    "gateway/fronts/json_depth.py",
    "gateway/fronts/request_id.py",
    "gateway/fleet/balancer.py",
    "gateway/fleet/dispatch.py",
    "gateway/fleet/model_index.py",
    "gateway/fleet/router.py",
    "gateway/operations/metrics.py",
    "gateway/operations/step_costs.py",
    "gateway/operations/tallies.py",
    "gateway/pipeline/admission.py",
    "gateway/pipeline/answer_classes.py",
    "gateway/pipeline/cache_alias.py",
    "gateway/pipeline/cached.py",
    "gateway/pipeline/call.py",
    "gateway/pipeline/canary.py",
    "gateway/pipeline/cascade.py",
    "gateway/pipeline/forward.py",
    "gateway/pipeline/record.py",
    "gateway/pipeline/run.py",
    "gateway/state/auth.py",
    "gateway/state/body_budget.py",
    "gateway/state/cache.py",
    "gateway/state/coalesce.py",
    "gateway/state/limits.py",
    "gateway/upstream/grpc_over_http.py",
    "gateway/upstream/http_client.py",
    "gateway/upstream/model_infer_wire.py",
    "gateway/upstream/server.py",
)


EXT_SUFFIX = str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")
# The runtime every compiled module shares (mypyc's group library).
GROUP_LIBRARY = "gateway/compiled__mypyc"


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gateway_sources(root: Path) -> dict[str, str]:
    """Every gateway source, relative to `root`, with its hash: what a build is recorded against."""
    return {
        path.relative_to(root).as_posix(): source_hash(path)
        for path in sorted((root / "gateway").rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def stale_sources(manifest: dict[str, str], root: Path) -> list[str]:
    """The sources that no longer match the hash recorded at build time (or are gone)."""
    stale = []
    for path, digest in sorted(manifest.items()):
        source = root / path
        if not source.is_file() or source_hash(source) != digest:
            stale.append(path)
    return stale


def missing_extensions(root: Path) -> list[str]:
    """The extension modules of the compiled build that are not on disk (for this Python)."""
    wanted = [GROUP_LIBRARY, *(p.removesuffix(".py") for p in COMPILED)]
    return [f"{p}{EXT_SUFFIX}" for p in wanted if not (root / f"{p}{EXT_SUFFIX}").is_file()]


def build_problems(manifest: dict[str, str] | None, root: Path) -> list[str]:
    """Why the compiled build must not run (empty: it matches its sources and is complete)."""
    if manifest is None:
        return ["no compiled build (gateway/compiled.json)"]
    return [f"{p} changed" for p in stale_sources(manifest, root)] + [
        f"{p} is missing" for p in missing_extensions(root)
    ]


def read_manifest(path: Path = MANIFEST) -> dict[str, str] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning(
            "ignoring the compiled gateway build: %s is unreadable (%s); run `make setup`", path, exc
        )
        return None
    sources = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(sources, dict):
        logger.warning("ignoring the compiled gateway build: %s has no 'sources'; run `make setup`", path)
        return None
    return {str(k): str(v) for k, v in sources.items()}


class _SourceOnly(importlib.abc.MetaPathFinder):
    """Finds every gateway module's `.py` file, ahead of any extension module beside it (those of
    today's list, and those an older build with a longer list left behind)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("gateway.") or not path:
            return None
        loader = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, loader).find_spec(fullname)
            if spec is not None:
                return spec
        return None


_active = "pure"


def active() -> str:
    """`compiled` or `pure`: the build this process runs (set by `install`)."""
    return _active


def install() -> str:
    """Choose the build for this process (see the module docstring); returns the choice."""
    global _active
    wanted = os.environ.get(ENV, "compiled").strip().lower() or "compiled"
    if wanted not in BUILDS:
        raise SystemExit(f"{ENV}={wanted!r} is not a build; use one of {', '.join(BUILDS)}")
    manifest = read_manifest()
    use = wanted == "compiled" and manifest is not None
    if use:
        problems = build_problems(manifest, PACKAGE_DIR.parent)
        if problems:
            logger.warning(
                "the compiled gateway build does not match its sources (%s): running the pure Python "
                "build; run `make setup` to compile again",
                ", ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else ""),
            )
            use = False
    if not use and not any(isinstance(f, _SourceOnly) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceOnly())
    _active = "compiled" if use else "pure"
    return _active
