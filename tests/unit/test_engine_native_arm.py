"""The native kernels compile for aarch64 (the ``neon`` level) with a cross-compiler.

Compiled to object files only, never run: no Arm machine is at hand. Skipped when
``aarch64-linux-gnu-g++`` is missing (Debian: ``apt-get install g++-aarch64-linux-gnu``).
The objects are kept in the kernel cache (``$XDG_CACHE_HOME/aegaeon/kernels``) under a
key of everything the compile reads (sources, headers, torch, flags, the compiler's
version): a later run with the same inputs checks those objects instead of compiling
again, and any change to a source or a flag compiles anew.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from aegaeon_engine import native

CROSS = "aarch64-linux-gnu-g++"
pytestmark = pytest.mark.skipif(shutil.which(CROSS) is None,
                                reason=f"no {CROSS} (apt-get install g++-aarch64-linux-gnu)")
CHECK = ('#include "simd.h"\n'  # simd.h took its NEON branch, not the scalar code
         'static_assert(aegaeon_simd::kLanes == 4 && aegaeon_simd::kParts == 4, '
         '"NEON: F16 is four float32x4_t");\n')
DONE = "compiled"  # written once every object compiled


def _command(source: Path, obj: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    flags = [f for f in native.compile_flags("neon") if f != "-O3"]
    includes = [arg for path in include_paths() for arg in ("-isystem", path)]
    # -O1: the same code paths as -O3, in half the time; warnings are errors
    return [CROSS, "-std=c++17", "-O1", "-Werror", *flags, *includes, f"-I{native._CSRC}",
            "-c", str(source), "-o", str(obj)]


def _cache_dir() -> Path:
    """Where this compile's objects are kept: keyed by every file of the kernel sources,
    the ``neon`` level's build key (torch, flags), the check, and the compiler."""
    from aegaeon_common.env import read_env

    version = subprocess.run([CROSS, "--version"], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    digest = hashlib.sha256()
    for path in sorted(native._CSRC.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(native._CSRC).as_posix().encode())
            digest.update(path.read_bytes())
    for part in (native.build_key("neon"), CHECK, version, " ".join(_command(Path(), Path()))):
        digest.update(part.encode())
    return read_env().cache_dir / "kernels" / f"cross-aarch64-{digest.hexdigest()[:16]}"


def _compile(out: Path) -> None:
    """Every source to an object in ``out`` (in parallel); fails on the first that does not."""
    check = out / "neon_check.cpp"
    check.write_text(CHECK)
    sources = [check, *(native._CSRC / name for name in native._SOURCES)]
    procs = [subprocess.Popen(_command(src, out / f"{src.stem}.o"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for src in sources]
    for src, proc in zip(sources, procs, strict=True):
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{src.name} does not compile for aarch64:\n{log[-4000:]}"


def test_kernels_compile_for_aarch64(tmp_path: Path) -> None:
    cache = _cache_dir()
    if not (cache / DONE).exists():
        build = tmp_path / "build"
        build.mkdir()
        _compile(build)
        (build / DONE).touch()
        cache.parent.mkdir(parents=True, exist_ok=True)
        aside = cache.parent / f"{cache.name}.{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        shutil.copytree(build, aside)
        try:
            aside.rename(cache)  # atomic: another session may have put it there first
        except OSError:
            shutil.rmtree(aside, ignore_errors=True)
    stems = ["neon_check", *(Path(name).stem for name in native._SOURCES)]
    for stem in stems:
        header = (cache / f"{stem}.o").read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and header[18:20] == b"\xb7\x00"  # EM_AARCH64
