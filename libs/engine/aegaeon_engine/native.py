"""The engine's C++ kernels (``csrc/``): one library per ISA level, built once per
machine, the best level the CPU supports chosen at run time.

Levels (ascending; each needs the CPU flags of the ones below it too):

| level | CPU flags (/proc/cpuinfo) | compiled with | bfloat16 multiplied |
|---|---|---|---|
| ``avx2`` | avx2 fma f16c | -mavx2 -mfma -mf16c | in float32 (widened) |
| ``avx512`` | + avx512f/bw/vl/dq | + -mavx512f -mavx512bw -mavx512vl -mavx512dq | in float32 |
| ``amx`` | + avx512_bf16 amx_tile amx_bf16 | + -mavx512bf16 -mamx-tile -mamx-bf16 | natively |
| ``neon`` | aarch64 (asimd) | -march=armv8-a | in float32 |

Each level is built with explicit flags (never ``-march=native``), so an AMX
machine builds and runs the AVX2 library too, and registers its kernels in
its own namespace, ``torch.ops.aegaeon_<level>``: every level can be loaded in
one process (the tests run each kernel on every level the CPU supports).

``native_isa()`` is the level in use: the highest the CPU supports, or the one
``AEGAEON_ISA`` names (read in ``aegaeon_common.env``; a level this CPU lacks
is an error, never a silent downgrade). A level whose build or load fails
falls back to the next lower one, finally to the torch path, with one log
line saying which failed and why. ``AEGAEON_NATIVE=0`` turns them all off.
``native_ops()`` is the chosen level's ``torch.ops`` namespace (or None);
``native_ops(level)`` a given level's.

Builds live under ``$XDG_CACHE_HOME/aegaeon/kernels/<key>`` (not /tmp, which
gets cleaned); the key (``build_key(level)``) hashes the sources, torch's
version, the machine, the level and its flags. A finished build is loaded with
``torch.ops.load_library`` alone; only a missing one imports
``torch.utils.cpp_extension`` (and ninja) to compile, ~10-20 s a level;
``prebuild`` compiles several levels in parallel processes. Nothing here runs
at import.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

# the levels and the CPU's flags live in isa.py (no torch); named here too, as before
from aegaeon_engine.isa import (
    AVX2_FLAGS,
    LEVELS,
    IsaLevel,
    cpu_flags,
    cpu_model,
    supported_levels,
)

_SOURCES = ("attention.cpp", "dense.cpp", "quant.cpp", "stack.cpp")
_HEADERS = ("simd.h",)
# -ffp-contract=off: no fused multiply-add the source does not write (rounding as torch's)
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-Wall", "-fvisibility=hidden")
_LDFLAGS = ("-fopenmp",)
_DONE = "built"  # marker written after a build loaded successfully
_CSRC = Path(__file__).parent / "csrc"

log = logging.getLogger(__name__)
_BY_NAME = {level.name: level for level in LEVELS}


def level(name: str) -> IsaLevel:
    """The level called ``name`` (ValueError if there is none)."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown ISA level {name!r} (levels: {', '.join(_BY_NAME)})")
    return _BY_NAME[name]


def build_key(name: str) -> str:
    """Identifies one level's build: sources, torch, machine, level and flags."""
    lv = level(name)
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update((_CSRC / source).read_bytes())
    for part in (torch.__version__, platform.machine(), " ".join(_CFLAGS), " ".join(lv.cflags)):
        digest.update(part.encode())
    return f"{torch.__version__.replace('+', '-')}-{name}-{digest.hexdigest()[:16]}"


def compile_flags(name: str) -> list[str]:
    """The compiler flags of level ``name`` (besides torch's own)."""
    lv = level(name)
    return [*_CFLAGS, *lv.cflags, f"-DAEGAEON_OPS={lv.namespace}"]


def _directory(name: str) -> Path:
    from aegaeon_common.env import read_env

    return read_env().cache_dir / "kernels" / build_key(name)


def _build(name: str, directory: Path) -> None:
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
            name=level(name).namespace, sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=compile_flags(name), extra_ldflags=list(_LDFLAGS),
            build_directory=str(directory), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    log.info("built the %s kernels in %.1f s (%s)", name, time.perf_counter() - start,
             directory)


_loaded: dict[str, Any] = {}  # level -> its torch.ops namespace, or the reason it failed (str)


def _load(name: str) -> Any:
    """Level ``name``'s namespace (built first if missing), or why it failed (str)."""
    if name not in _loaded:
        lv = level(name)
        try:
            directory = _directory(name)
            library = directory / f"{lv.namespace}.so"
            if (directory / _DONE).exists() and library.exists():
                torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
            else:
                _build(name, directory)  # loads the library too
                (directory / _DONE).touch()
            _loaded[name] = getattr(torch.ops, lv.namespace)
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
            _loaded[name] = _reason(exc)
    return _loaded[name]


def _reason(exc: BaseException) -> str:
    """One line of why a build or load failed: the compiler's first error, if any."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]  # the compiler's "file:line: error: ..."
    line = (errors or lines or [""])[0]
    return f"{type(exc).__name__}: {line[:300]}"


def prebuild(names: tuple[str, ...] | list[str]) -> None:
    """Build the levels ``names`` not built yet, in parallel: one in this process (which
    loads it), the others in child processes (loaded here when first used)."""
    missing = [n for n in names if not (_directory(n) / _DONE).exists()]
    procs = [subprocess.Popen([sys.executable, "-m", "aegaeon_engine.native", "--build", n],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for n in missing[1:]]
    if missing:
        _load(missing[0])  # this process builds one of them meanwhile
    for proc in procs:
        proc.communicate()


def forced_isa() -> str | None:
    """The level ``AEGAEON_ISA`` forces, checked against this CPU (ValueError if it lacks it)."""
    from aegaeon_common.env import read_env

    name = read_env().isa
    if name is None:
        return None
    level(name)
    if name not in supported_levels():
        raise ValueError(f"AEGAEON_ISA={name}: this CPU ({cpu_model()}) supports "
                         f"{', '.join(supported_levels()) or 'no native level'}")
    return name


@functools.cache
def _select() -> tuple[str | None, Any]:
    """The level in use and its namespace (see the module docstring); logs failures once."""
    from aegaeon_common.env import read_env

    if not read_env().native_kernels:
        return None, None
    supported = supported_levels()
    forced = forced_isa()
    candidates = supported[:supported.index(forced) + 1] if forced else supported
    failures: list[str] = []
    for name in reversed(candidates):
        ops = _load(name)
        if not isinstance(ops, str):
            if failures:
                log.warning("native kernels: %s; using %s", "; ".join(failures), name)
            return name, ops
        failures.append(f"{name} unavailable ({ops})")
    if not supported:
        failures.append(f"no native level for this CPU ({platform.machine()}: needs "
                        f"{' '.join(sorted(AVX2_FLAGS))} on x86_64, asimd on aarch64)")
    log.warning("native kernels: %s; using the torch path", "; ".join(failures))
    return None, None


def expected_isa() -> str | None:
    """The level ``native_isa()`` will pick, from the CPU and the environment alone
    (nothing built or loaded; a level whose build would fail is not foreseen)."""
    from aegaeon_common.env import read_env

    if not read_env().native_kernels:
        return None
    supported = supported_levels()
    return forced_isa() or (supported[-1] if supported else None)


def native_isa() -> str | None:
    """The level the engine's kernels run at (None: the torch path)."""
    return _select()[0]


def native_ops(name: str | None = None) -> Any | None:
    """``torch.ops.aegaeon_<level>`` of the chosen level (``name`` None) or of level
    ``name``; None when unavailable (turned off, or it failed to build: logged)."""
    if name is None:
        return _select()[1]
    if name not in supported_levels():  # it would build, then die on an illegal instruction
        level(name)
        raise ValueError(f"ISA level {name} is not supported by this CPU ({cpu_model()}: "
                         f"{', '.join(supported_levels()) or 'no native level'})")
    ops = _load(name)
    if isinstance(ops, str):
        log.warning("native kernels: %s unavailable (%s)", name, ops)
        return None
    return ops


def bf16_native(name: str) -> bool:
    """Whether bfloat16 is multiplied natively at level ``name`` on this CPU: the level's
    library does (amx), or it is the CPU's best level and the CPU has AVX512-BF16 for
    torch's own matmuls (e.g. AMD Zen 4: avx512). A level below the best (forced)
    behaves as a CPU with only that level's features."""
    if level(name).bf16_native:
        return True
    supported = supported_levels()
    return bool(supported) and name == supported[-1] and "avx512_bf16" in cpu_flags()


def forget() -> None:
    """Forget the choice (tests that change the environment); loaded libraries stay."""
    _select.cache_clear()
    for name in [n for n, ops in _loaded.items() if isinstance(ops, str)]:
        del _loaded[name]


def main() -> int:
    """``python -m aegaeon_engine.native --build LEVEL``: build one level (see ``prebuild``)."""
    parser = argparse.ArgumentParser(description="build one level of the native kernels")
    parser.add_argument("--build", required=True, choices=sorted(_BY_NAME))
    ops = _load(parser.parse_args().build)
    if isinstance(ops, str):
        print(ops, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
