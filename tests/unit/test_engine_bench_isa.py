"""What the benches report about their machine, and how ``bench engine --isa`` emulates a
CPU of a level (no benchmark runs here)."""

from __future__ import annotations

import argparse

import pytest
import torch
from aegaeon_bench.common import machine_info
from aegaeon_bench.engine import bench as engine_bench
from aegaeon_engine import native


def test_machine_info_names_cpu_level_threads_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AEGAEON_ISA", raising=False)
    monkeypatch.delenv("AEGAEON_NATIVE", raising=False)
    info = machine_info(threads=3)
    assert info["cpu_model"] == native.cpu_model() and info["cpu_model"]
    assert info["threads"] == 3 and info["torch"] == torch.__version__
    levels = native.supported_levels()
    assert info["isa"] == (levels[-1] if levels else "torch")
    assert machine_info("avx2")["isa"] == "avx2"  # the engine's own level when it ran one
    monkeypatch.setenv("AEGAEON_NATIVE", "0")
    assert machine_info()["isa"] == "torch"


def test_every_level_can_be_emulated() -> None:
    assert set(engine_bench.EMULATE) == {level.name for level in native.LEVELS}
    for name in ("avx2", "avx512"):  # torch capped below what this CPU may have
        caps = engine_bench.EMULATE[name]
        assert set(caps) == {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                             "MKL_ENABLE_INSTRUCTIONS"}


def test_emulation_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``--isa``, or already in the child (AEGAEON_ISA set to it): run here."""
    monkeypatch.setenv("AEGAEON_ISA", "avx2")
    assert engine_bench._emulate(argparse.Namespace(isa="avx2")) is None
    assert engine_bench._emulate(argparse.Namespace(isa=None)) is None
