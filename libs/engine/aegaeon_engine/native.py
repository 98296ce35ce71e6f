"""The engine's C++ kernels (``csrc/``): built once per machine, loaded on first use.

``native_ops()`` returns ``torch.ops.aegaeon`` with the kernels registered,
or None when they are turned off (``AEGAEON_NATIVE=0``) or cannot be built
or loaded here; a failure is logged once and the engine keeps its torch path.

Builds live under ``$XDG_CACHE_HOME/aegaeon/kernels/<key>`` (not /tmp, which
gets cleaned); the key hashes the sources, torch's version, the compiler
flags and the CPU's feature flags, since the code is built for
``-march=native``: another CPU, or another torch, builds its own. A finished
build is loaded with ``torch.ops.load_library`` alone; only a missing one
imports ``torch.utils.cpp_extension`` (and ninja) to compile, ~20 s.
Nothing here runs at import.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

_SOURCES = ("attention.cpp", "dense.cpp")
_HEADERS = ("simd.h",)
_NAME = "aegaeon_native"
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-Wall")
_LDFLAGS = ("-fopenmp",)
_DONE = "built"  # marker written after a build loaded successfully

log = logging.getLogger(__name__)


def _cpu_features() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    """Identifies one build: sources, torch, flags and CPU features."""
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((Path(__file__).parent / "csrc" / name).read_bytes())
    for part in (torch.__version__, platform.machine(), " ".join(_CFLAGS), _cpu_features()):
        digest.update(part.encode())
    return f"{torch.__version__.replace('+', '-')}-{digest.hexdigest()[:16]}"


def _build(directory: Path) -> None:
    import ninja  # type: ignore[import-untyped,unused-ignore]
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # cpp_extension runs `ninja` from PATH; the venv's bin (PyPI's ninja) is not on it
    # when the interpreter is run by path, so it is added for the build's duration
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, path))
    try:
        cpp_extension.load(
            name=_NAME, sources=[str(Path(__file__).parent / "csrc" / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
            build_directory=str(directory), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    log.info("built the native kernels in %.1f s (%s)", time.perf_counter() - start, directory)


@functools.cache
def native_ops() -> Any | None:
    """``torch.ops.aegaeon`` once its kernels are loaded; None when unavailable (see above)."""
    from aegaeon_common.env import read_env

    env = read_env()
    if not env.native_kernels:
        return None
    try:
        directory = env.cache_dir / "kernels" / build_key()
        library = directory / f"{_NAME}.so"
        if (directory / _DONE).exists() and library.exists():
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        else:
            _build(directory)  # loads the library too
            (directory / _DONE).touch()
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
        log.warning("native kernels unavailable, using the torch path: %s", exc)
        return None
    return torch.ops.aegaeon
