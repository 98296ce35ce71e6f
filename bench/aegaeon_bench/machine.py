"""What machine a benchmark ran on: one record in every bench's JSON (engine, switch,
serve), so numbers from different CPUs or kernel levels are never confused."""

from __future__ import annotations

from typing import Any


def machine_info(isa: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """``cpu_model``, ``isa`` (the native kernels' level in use: ``isa`` when the bench
    ran an engine, else the level an engine here would pick; ``torch`` for the torch
    path), ``threads`` (torch threads per engine; None where the bench cannot know,
    e.g. a server's) and ``torch`` (its version)."""
    import torch
    from aegaeon_engine.native import cpu_model, expected_isa

    return {
        "cpu_model": cpu_model(),
        "isa": isa or expected_isa() or "torch",
        "threads": threads,
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
    }
