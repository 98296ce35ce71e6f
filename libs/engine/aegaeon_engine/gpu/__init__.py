"""The engine's Triton kernels (CUDA; on the CPU only under ``TRITON_INTERPRET=1``).

Nothing here is imported unless a Triton kernel is about to run: importing
``aegaeon_engine`` needs neither Triton nor CUDA. :func:`triton_problem` says why
the kernels cannot run in this process (``None``: they can), so a caller picks
the torch path instead and says so once.

- ``paged_attention``: decode attention over the paged KV layout (and the
  attention of a prefill chunk that continues a cached prefix).
- ``norm``: RMSNorm, optionally after adding a residual in place.
- ``rope_write``: q/k norm, rope and the K/V slot write of a layer, one kernel.
- ``fp8``: per-token FP8 quantization of activations; the FP8-weight GEMV of a
  decode batch.
- ``ops``: ``TritonOps`` (model.LayerOps on these kernels) and ``TritonAttention``.
"""

from __future__ import annotations

import functools
import importlib.util
import os


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``: on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


@functools.cache
def _import_problem() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # a broken install
        return f"triton does not import: {exc}"
    return None


def triton_problem(device_type: str) -> str | None:
    """Why the Triton kernels cannot run on a ``device_type`` device here (None: they can)."""
    problem = _import_problem()
    if problem is not None:
        return problem
    if device_type == "cuda":
        return None if not interpreted() else "TRITON_INTERPRET=1 runs kernels on the CPU"
    if interpreted():
        return None
    return f"Triton kernels run on CUDA devices (on {device_type} only under TRITON_INTERPRET=1)"
