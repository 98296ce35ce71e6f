"""The native kernels' ISA levels and what this CPU has, without torch.

``aegaeon_engine.native`` builds and loads a level's library; this module only
knows the levels (their CPU flags and compiler flags) and reads /proc/cpuinfo,
so a supervisor can check ``AEGAEON_ISA`` against the CPU before it starts
anything (``aegaeon_runtime.preflight``) without importing torch.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IsaLevel:
    """One library: what the CPU must have, how it is compiled."""

    name: str
    machine: str  # platform.machine() it is for
    cpu_flags: frozenset[str]
    cflags: tuple[str, ...]
    bf16_native: bool  # multiplies bfloat16 natively (else widens to float32)

    @property
    def namespace(self) -> str:
        """Its ``torch.ops`` namespace."""
        return f"aegaeon_{self.name}"


AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})  # the least an x86_64 level needs
_AVX512 = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_AMX = _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
LEVELS: tuple[IsaLevel, ...] = (  # ascending per machine
    IsaLevel("avx2", "x86_64", AVX2_FLAGS, _AVX2_FLAGS, False),
    IsaLevel("avx512", "x86_64", _AVX512, _AVX512_FLAGS, False),
    IsaLevel("amx", "x86_64", _AMX, (*_AVX512_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
             True),
    IsaLevel("neon", "aarch64", frozenset({"asimd"}), ("-march=armv8-a",), False),
)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` / ``Features`` of /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``model name`` of /proc/cpuinfo, else the platform's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_levels(flags: frozenset[str] | None = None,
                     machine: str | None = None) -> tuple[str, ...]:
    """The levels a CPU with ``flags`` (default: this one's) can run, ascending."""
    flags = cpu_flags() if flags is None else flags
    machine = machine or platform.machine()
    return tuple(lv.name for lv in LEVELS if lv.machine == machine and lv.cpu_flags <= flags)
