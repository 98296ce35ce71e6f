"""The native kernels compile for aarch64 (the ``neon`` level) with a cross-compiler.

Compiled to object files only, never run: no Arm machine is at hand. Skipped when
``aarch64-linux-gnu-g++`` is missing (Debian: ``apt-get install g++-aarch64-linux-gnu``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from aegaeon_engine import native

CROSS = "aarch64-linux-gnu-g++"
pytestmark = pytest.mark.skipif(shutil.which(CROSS) is None,
                                reason=f"no {CROSS} (apt-get install g++-aarch64-linux-gnu)")


def _command(source: Path, obj: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    flags = [f for f in native.compile_flags("neon") if f != "-O3"]
    includes = [arg for path in include_paths() for arg in ("-isystem", path)]
    # -O1: the same code paths as -O3, in half the time; warnings are errors
    return [CROSS, "-std=c++17", "-O1", "-Werror", *flags, *includes, f"-I{native._CSRC}",
            "-c", str(source), "-o", str(obj)]


def test_kernels_compile_for_aarch64(tmp_path: Path) -> None:
    check = tmp_path / "neon_check.cpp"  # simd.h took its NEON branch, not the scalar code
    check.write_text('#include "simd.h"\n'
                     'static_assert(aegaeon_simd::kLanes == 4 && aegaeon_simd::kParts == 4, '
                     '"NEON: F16 is four float32x4_t");\n')
    sources = [check, *(native._CSRC / name for name in native._SOURCES)]
    procs = [subprocess.Popen(_command(src, tmp_path / f"{src.stem}.o"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for src in sources]
    for src, proc in zip(sources, procs, strict=True):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{src.name} does not compile for aarch64:\n{out[-4000:]}"
        header = (tmp_path / f"{src.stem}.o").read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and header[18:20] == b"\xb7\x00"  # EM_AARCH64
