"""The two builds of the gateway's request path (gateway/compiled_build.py): the suite runs the build
`make test` asked for (compiled by default), the pure-Python fallback answers exactly as the compiled
build does, and a compiled build older than its sources never runs."""

from __future__ import annotations

import ast
import gzip
import http.client
import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from gateway import compiled_build
from tests.gateway.conftest import gateway_config

ROOT = Path(__file__).resolve().parents[2]
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def _wanted() -> str:
    return os.environ.get(compiled_build.ENV, "compiled") or "compiled"


def test_this_run_uses_the_build_it_asked_for() -> None:
    """`make test` runs the compiled build (GATEWAY_BUILD=pure: the sources); a compiled build that
    is missing or older than its sources fails here rather than silently testing the other one."""
    import gateway.pipeline.run as module

    assert compiled_build.active() == _wanted(), (
        f"asked for the {_wanted()} build, running {compiled_build.active()}: run `make setup` "
        "(it compiles the gateway; the gateway's log says which source changed)"
    )
    assert str(module.__file__).endswith(EXT_SUFFIX if _wanted() == "compiled" else ".py")


def _imported_from(build: str) -> str:
    code = "import gateway.pipeline.run as m, gateway.compiled_build as b; print(b.active(), m.__file__)"
    env = {**os.environ, compiled_build.ENV: build}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_the_pure_build_runs_the_sources_beside_the_extensions() -> None:
    active, path = _imported_from("pure").split()
    assert active == "pure" and path.endswith("run.py")


def test_an_unknown_build_is_refused_by_name() -> None:
    env = {**os.environ, compiled_build.ENV: "fast"}
    out = subprocess.run([sys.executable, "-c", "import gateway"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "SKEWSERVE_GATEWAY_BUILD='fast' is not a build" in out.stderr


def test_a_source_changed_since_the_build_is_found(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    kept, changed = tmp_path / "gateway" / "kept.py", tmp_path / "gateway" / "changed.py"
    kept.write_text("A = 1\n")
    changed.write_text("B = 1\n")
    manifest = {
        "gateway/kept.py": compiled_build.source_hash(kept),
        "gateway/changed.py": compiled_build.source_hash(changed),
        "gateway/removed.py": "0" * 64,
    }
    changed.write_text("B = 2\n")
    assert compiled_build.stale_sources(manifest, tmp_path) == ["gateway/changed.py", "gateway/removed.py"]


def test_the_build_is_recorded_against_every_gateway_source() -> None:
    """Interpreted sources too: compiled code checks the types it saw in them (an `int` constant
    made a float in an interpreted module once ran a compiled build into TypeError)."""
    manifest = compiled_build.read_manifest()
    if _wanted() == "pure" and manifest is None:
        return  # GATEWAY_BUILD=pure built nothing
    assert manifest is not None, "no gateway/compiled.json: run `make setup`"
    assert sorted(manifest) == sorted(compiled_build.gateway_sources(ROOT))
    assert (
        "gateway/fronts/exact_json.py" in manifest
        and "gateway/fronts/exact_json.py" not in compiled_build.COMPILED
    )
    assert compiled_build.build_problems(manifest, ROOT) == []


def test_a_missing_extension_module_sets_the_build_aside(tmp_path: Path) -> None:
    """One extension gone would mix two builds (a compiled class and its interpreted twin)."""
    (tmp_path / "gateway" / "pipeline").mkdir(parents=True)
    for path in (compiled_build.GROUP_LIBRARY, *(p.removesuffix(".py") for p in compiled_build.COMPILED)):
        (tmp_path / f"{path}{compiled_build.EXT_SUFFIX}").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{path}{compiled_build.EXT_SUFFIX}").touch()
    assert compiled_build.build_problems({}, tmp_path) == []
    (tmp_path / f"gateway/pipeline/run{compiled_build.EXT_SUFFIX}").unlink()
    assert compiled_build.build_problems({}, tmp_path) == [
        f"gateway/pipeline/run{compiled_build.EXT_SUFFIX} is missing"
    ]
    assert compiled_build.build_problems(None, tmp_path) == ["no compiled build (gateway/compiled.json)"]


def test_compiled_modules_give_each_caught_exception_type_its_own_name() -> None:
    """mypyc types an `except ... as name` variable by its first handler in the function: a second
    handler of another type binding the same name raises TypeError when it catches (seen: a
    ValueError caught as `exc` after `except _Duplicate as exc` answered 500)."""
    clashes = []
    for path in compiled_build.COMPILED:
        tree = ast.parse((ROOT / path).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    caught = ast.unparse(node.type) if node.type is not None else "BaseException"
                    types.setdefault(node.name, set()).add(caught)
            clashes += [
                f"{path}:{fn.lineno} {fn.name}: {n} {sorted(t)}" for n, t in types.items() if len(t) > 1
            ]
    assert not clashes, "\n".join(clashes)


def _unmarked_module_names(tree: ast.Module) -> list[tuple[str, int]]:
    """Module-level names bound by assignment without `Final`, other than TypeVars and aliases of
    types (which cannot be Final)."""
    unmarked = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            if "Final" not in ast.unparse(node.annotation):
                unmarked.append((node.target.id, node.lineno))
        elif isinstance(node, ast.Assign):
            value = ast.unparse(node.value)
            if value.startswith("TypeVar(") or value.startswith(("Callable[", "Literal[")) or " | " in value:
                continue
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                unmarked += [(n.id, node.lineno) for n in names if isinstance(n, ast.Name)]
    return [(name, line) for name, line in unmarked if not name.startswith("__")]


def test_compiled_modules_mark_their_module_names_final() -> None:
    """Compiled code reads a module name by a lookup in the module's dict each time, unless the
    name is Final: then it is a C static, or the constant itself. Found in the call graph: 2^63 looked
    up for each number of a request's data; marking them all Final took one in twenty of an
    uncached request's instructions."""
    unmarked = [
        f"{path}:{line} {name}"
        for path in compiled_build.COMPILED
        for name, line in _unmarked_module_names(ast.parse((ROOT / path).read_text()))
    ]
    assert not unmarked, "mark these `Final` (or move them out of the compiled modules):\n" + "\n".join(
        unmarked
    )


def _from_an_extension_module(cls: type) -> bool:
    """A class a C extension defines (Cython's, for one), other than Python's builtins and our own."""
    if cls.__module__ == "builtins" or cls.__module__.split(".")[0] == "gateway":
        return False
    source = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return source.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_no_compiled_class_derives_from_an_extension_modules_class() -> None:
    """mypyc cannot build on such a base (its docs: most non-native extension classes cannot be base
    classes), and does not say so: the class compiles and crashes the process when used (seen: the
    gRPC bridge's abort, a subclass of grpc's Cython AbortError, killed its worker on the first
    refused call). Such classes live in interpreted modules (gateway/errors.py); Python classes such
    as asyncio.Protocol are fine bases."""
    offenders = []
    for path in compiled_build.COMPILED:
        module = importlib.import_module(compiled_build.module_name(path))
        for node in ast.parse((ROOT / path).read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            for expr in node.bases:
                base = eval(ast.unparse(expr), vars(module))  # noqa: S307 (our own source's names)
                if isinstance(base, type) and any(_from_an_extension_module(c) for c in base.__mro__):
                    offenders.append(f"{path}:{node.lineno} {node.name}({ast.unparse(expr)})")
    assert not offenders, "\n".join(offenders)


# --- the two builds side by side, against one real Triton ---------------------------------------


def _features(seed: int) -> list[float]:
    return [round(float(v), 4) for v in np.random.default_rng(seed).standard_normal(8)]


def _json_body(seed: int, **extra: Any) -> bytes:
    inp = {"name": "features", "shape": [1, 8], "datatype": "FP32", "data": _features(seed)}
    return json.dumps({"id": f"r{seed}", "inputs": [inp], **extra}).encode()


def _nan_body(seed: int) -> bytes:
    body = _json_body(seed)
    start = body.index(b'"data": [') + len(b'"data": [')
    return body[:start] + b"NaN" + body[body.index(b",", start) :]


def _binary_body(seed: int) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": [1, 8],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 32},
                }
            ]
        }
    ).encode()
    data = np.asarray(_features(seed), dtype=np.float32).tobytes()
    return header + data, {"Inference-Header-Content-Length": str(len(header))}


def _requests() -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(name, model, body, headers): answers, refusals and the cases the fast JSON reader steps aside for."""
    binary, binary_headers = _binary_body(3)
    dup = b'{"inputs":[{"name":"features","shape":[1,8],"datatype":"FP32","data":[1,2,3,4,5,6,7,8]}],"inputs":[]}'
    return [
        ("json", "lt", _json_body(1), {}),
        ("json again (a cache hit)", "lt", _json_body(1), {}),
        ("json, uncached model", "lt_nocache", _json_body(2), {}),
        ("json, escaped name", "lt", _json_body(4).replace(b'"features"', b'"feat\\u0075res"'), {}),
        ("json, client timeout", "lt", _json_body(5, parameters={"timeout": 5_000_000}), {}),
        ("binary", "lt", binary, binary_headers),
        ("gzip", "lt", gzip.compress(_json_body(6)), {"Content-Encoding": "gzip"}),
        ("duplicate key", "lt", dup, {}),
        ("number beyond a double", "lt", _json_body(7).replace(b'"data": [', b'"data": [1e999, '), {}),
        ("NaN in data", "lt", _nan_body(8), {}),
        ("more values than the shape", "lt", _json_body(13).replace(b'"data": [', b'"data": [1.5, '), {}),
        ("timeout beyond uint64", "lt", _json_body(9, parameters={"timeout": 2**64}), {}),
        ("shape not integers", "lt", _json_body(10).replace(b"[1, 8]", b"[1, 8.5]"), {}),
        ("malformed", "lt", b'{"inputs": [', {}),
        ("not an object", "lt", b"[1, 2]", {}),
        ("wrong input name", "lt", _json_body(11).replace(b'"features"', b'"nope"'), {}),
        ("unknown model", "no_such_model", _json_body(12), {}),
    ]


def _post(address: str, model: str, body: bytes, headers: dict[str, str]) -> tuple[int, str | None, bytes]:
    conn = http.client.HTTPConnection(address, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("x-skewserve-cache"), r.read()
    finally:
        conn.close()


def _grpc_outputs(address: str, seed: int) -> tuple[str, list[float]]:
    client = grpcclient.InferenceServerClient(address)
    try:
        inp = grpcclient.InferInput("features", [1, 8], "FP32")
        inp.set_data_from_numpy(np.asarray([_features(seed)], dtype=np.float32))
        result = client.infer("lt", [inp], request_id=f"g{seed}")
        out = result.get_response().outputs[0].name
        return result.get_response().id, result.as_numpy(out).ravel().tolist()
    finally:
        client.close()


@pytest.mark.slow
def test_the_pure_build_answers_exactly_as_the_compiled_build(one_triton, make_gateway) -> None:
    """Byte for byte, request by request, on both fronts: the fallback is kept honest."""
    builds = {}
    for build in ("compiled", "pure"):
        gw = make_gateway(
            gateway_config(one_triton, cache={"models": ["lt"]}), env={compiled_build.ENV: build}
        )
        builds[build] = gw
        want = build if build == "pure" or _wanted() == "compiled" else "pure"
        assert f'skewserve_gateway_build_info{{build="{want}"}} 1.0' in gw.metrics()
    answers: dict[str, list[tuple[str, int, str | None, bytes]]] = {}
    for build, gw in builds.items():
        answers[build] = [(name, *_post(gw.http, model, body, h)) for name, model, body, h in _requests()]
    for compiled, pure in zip(answers["compiled"], answers["pure"], strict=True):
        assert compiled == pure, f"{compiled[0]}: the builds differ"
    statuses = {name: status for name, status, _, _ in answers["pure"]}
    assert statuses["json"] == statuses["binary"] == statuses["gzip"] == 200
    assert answers["pure"][1][2] == "hit"
    # Refused by the gateway, or by Triton (its 500 for data it cannot read is the client's 400).
    refused = (
        "duplicate key",
        "number beyond a double",
        "more values than the shape",
        "malformed",
    )
    assert {name: statuses[name] for name in refused} == dict.fromkeys(refused, 400)
    assert statuses["NaN in data"] == 200  # Triton's reader takes NaN in tensor data
    assert statuses["unknown model"] == 404
    assert _grpc_outputs(builds["compiled"].grpc, 20) == _grpc_outputs(builds["pure"].grpc, 20)
