"""Compile the gateway's hot path with mypyc (`make setup` runs this; see gateway/compiled_build.py).

Each module in `COMPILED` becomes an extension module beside its source, sharing one runtime library
(`gateway/compiled__mypyc*.so`); `gateway/compiled.json` records the hash of every gateway source as
read before the compile (a file saved during it makes the build stale, never falsely current), and
is written last, so an interrupted build is never taken for a complete one.

    python scripts/compile_gateway.py             # build (or rebuild) in place
    python scripts/compile_gateway.py --if-stale  # build unless the build matches every source (make setup)
    python scripts/compile_gateway.py --clean     # remove the extension modules and the manifest
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_DIR = ROOT / "build" / "mypyc"
GROUP = "gateway.compiled"


def extensions() -> list[Path]:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return sorted(p for p in (ROOT / "gateway").rglob(f"*{suffix}"))


def clean() -> None:
    from gateway.compiled_build import MANIFEST

    MANIFEST.unlink(missing_ok=True)
    for path in extensions():
        path.unlink()


def build(jobs: int) -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    from gateway.compiled_build import COMPILED, MANIFEST, gateway_sources

    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        raise SystemExit(
            f"error: {headers} is missing, so the gateway cannot be compiled: install this Python's headers "
            "(Debian: apt-get install python3-dev), or run the sources with `make setup GATEWAY_BUILD=pure`"
        )
    sources = gateway_sources(ROOT)
    clean()
    os.chdir(ROOT)
    modules = mypycify(
        list(COMPILED), opt_level="3", debug_level="0", group_name=GROUP, target_dir=str(BUILD_DIR / "c")
    )
    setup(
        name="skewserve-gateway-compiled",
        ext_modules=modules,
        script_args=[
            "-q",
            "build_ext",
            "--inplace",
            f"--build-temp={BUILD_DIR / 'temp'}",
            f"--parallel={jobs}",
        ],
    )
    manifest = {"tool": "mypyc", "compiled": list(COMPILED), "sources": sources}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"compiled {len(COMPILED)} gateway modules ({len(extensions())} extension modules)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clean", action="store_true", help="remove the compiled build")
    parser.add_argument(
        "--if-stale", action="store_true", help="build only when the build does not match the sources"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel C compiles")
    args = parser.parse_args()
    # The pure sources are what mypyc reads; importing gateway.compiled_build must not load extensions.
    os.environ["SKEWSERVE_GATEWAY_BUILD"] = "pure"
    sys.path.insert(0, str(ROOT))
    if args.clean:
        clean()
        return
    if args.if_stale:
        from gateway.compiled_build import build_problems, read_manifest

        problems = build_problems(read_manifest(), ROOT)
        if not problems:
            print("the compiled gateway build matches its sources")
            return
        print("compiling the gateway:", "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""))
    build(args.jobs)


if __name__ == "__main__":
    main()
