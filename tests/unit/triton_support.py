"""The Triton kernels' tests run them in Triton's interpreter on the CPU.

``TRITON_INTERPRET=1`` is set by tests/unit/conftest.py, before any test imports
``aegaeon_engine.gpu`` (Triton reads it when a kernel is defined). The
interpreter rounds float32 to bfloat16 and e4m3 by truncation or half-up where
a GPU rounds to nearest even, so 16-bit and FP8 outputs are compared within a
unit or two in the last place.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernels' CPU tests run under TRITON_INTERPRET=1 (set without a GPU); "
                "on a GPU test_engine_cuda.py and test_engine_graphs.py run them compiled",
                allow_module_level=True)

BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16 at its coarsest


def assert_close_dtype(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
                       atol: float = 1e-5, ulps: int = 2) -> None:
    """Equal within rounding: float32 tightly, 16-bit within ``ulps`` ulps (plus ``atol``):
    one for the interpreter's rounding, one for a chain of roundings that differ."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=max(atol, 1e-2),
                                   rtol=ulps * BF16_ULP)
