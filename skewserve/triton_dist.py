"""Locate the tritonserver shipped in the nvidia-pytriton wheel and prepare a runnable private copy.

The wheel ships the binary, the Python backend and one backend stub per Python version. Triton
expects the stub inside `backends/python/`, so, like pytriton's own launcher
(`pytriton/triton.py: _prepare_triton_inference_server`), we copy the distribution to a private
folder and put the stub for the running interpreter there, never writing into site-packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from skewserve.errors import TritonNotInstalled

STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonDistribution:
    """The tritonserver folder inside the installed nvidia-pytriton package."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def bundled_libs(self) -> Path:
        """Shared libraries auditwheel vendored (libcudart, libtritonserver...), found via a relative RPATH."""
        return self.root.parent.parent / "nvidia_pytriton.libs"

    def stub_for(self, python_version: str) -> Path:
        return self.root / "python_backend_stubs" / python_version / STUB_NAME


@dataclass(frozen=True)
class PreparedTriton:
    """A private, runnable copy of tritonserver with the stub for this interpreter in place."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backend_directory(self) -> Path:
        return self.root / "backends"

    @property
    def cache_directory(self) -> Path:
        return self.root / "caches"


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def locate_distribution() -> TritonDistribution:
    """Find tritonserver inside nvidia-pytriton, or say how to install it."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotInstalled(
            "the nvidia-pytriton package is not installed; it carries the tritonserver binary. "
            "Run `make setup` (or `pip install nvidia-pytriton`)."
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    dist = TritonDistribution(root)
    if not dist.binary.is_file():
        raise TritonNotInstalled(
            f"tritonserver binary not found at {dist.binary}; reinstall nvidia-pytriton "
            "(`pip install --force-reinstall nvidia-pytriton`)."
        )
    return dist


def _fingerprint(dist: TritonDistribution, version: str) -> str:
    stat = dist.binary.stat()
    raw = f"{dist.root}|{stat.st_size}|{stat.st_mtime_ns}|{version}".encode()
    return hashlib.sha256(raw).hexdigest()[:12]


def default_cache_root() -> Path:
    base = os.environ.get("SKEWSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "skewserve" if base else Path.home() / ".cache" / "skewserve"


def prepare_triton(cache_root: Path | None = None, version: str | None = None) -> PreparedTriton:
    """Return a prepared copy of tritonserver for this interpreter, building it once per version.

    The copy is built under a temporary name and renamed into place, so a half-made copy is
    never used by a concurrent or later caller.
    """
    dist = locate_distribution()
    version = version or python_version()
    stub = dist.stub_for(version)
    if not stub.is_file():
        available = sorted(p.name for p in (dist.root / "python_backend_stubs").iterdir() if p.is_dir())
        raise TritonNotInstalled(
            f"no Python backend stub for Python {version} in nvidia-pytriton (it has {', '.join(available)}); "
            "use one of those Python versions for the virtual environment."
        )
    cache_root = cache_root or default_cache_root()
    target = cache_root / f"tritonserver-py{version}-{_fingerprint(dist, version)}"
    if (target / "bin" / "tritonserver").is_file() and (target / "backends" / "python" / STUB_NAME).is_file():
        return PreparedTriton(target)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tritonserver-", dir=cache_root))
    try:
        copy = staging / "tritonserver"
        shutil.copytree(dist.root, copy, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy2(stub, copy / "backends" / "python" / STUB_NAME)
        try:
            os.rename(copy, target)
        except OSError:
            if not (target / "bin" / "tritonserver").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return PreparedTriton(target)


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so that Python-backend models import this venv's packages.

    The backend stub finds its interpreter through PATH, and it links against libpython, which
    lives in the interpreter's LIBDIR (pyenv and venvs do not put it on the loader path).
    """
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    # The private copy no longer sits where the binary's relative RPATH points, so the vendored
    # libraries go on the loader path explicitly.
    vendored = str(locate_distribution().bundled_libs)
    existing = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [libdir, vendored, existing] if p)
    # Every stub would otherwise start one OpenMP/BLAS thread per core and fight Triton for 2 cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    return env
