"""Market models as transformers reads them: the directory itself, or its weights dequantized.

transformers reads a market model's directory as it is when its weights are
float. Two kinds of market model it cannot read:

- GGUF blocks kept (``quantization_config.quant_method: gguf``, a GGUF import's
  Q8_0/Q4_0/Q4_1 matrices stored as U8 ``[rows, row_bytes]``): transformers
  reads GGUF blocks only from a ``.gguf`` file (and dequantizes them there), not
  from safetensors, so it takes them for float matrices of the wrong shape;
- FP8 (``compressed-tensors`` or ``fp8``): transformers needs the
  ``compressed-tensors`` package and kernels a CPU install lacks.

For those, `transformers_dir` writes the weights dequantized into a float dtype
(`aegaeon_market.hf_import`: the ``gguf`` package's dequantization for the
blocks, scale x code for FP8) into a folder the caller owns, once per model and
dtype: the same values the engine's quantized path computes with. Every
transformers-based measurement and test takes a market model through here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from aegaeon_engine.spec import FP8, QUANT_BLOCKS, ModelSpec


def transformers_unreadable(model_dir: Path) -> str | None:
    """Why transformers cannot load ``model_dir`` as it is (one line), or None when it can."""
    quant = ModelSpec.from_dir(model_dir).quant
    if quant is None:
        return None
    if quant.linear in QUANT_BLOCKS:
        return (f"{quant.linear} GGUF blocks stored as U8 rows (transformers reads GGUF blocks "
                "only from a .gguf file)")
    if quant.linear == FP8:
        return "FP8 weights (transformers needs compressed-tensors and kernels it lacks on CPU)"
    return f"{quant.linear} weights"


def transformers_dir(model_dir: Path, scratch: Path, dtype: str = "float32") -> Path:
    """``model_dir`` when transformers reads it as it is, else its weights dequantized to
    ``dtype`` in ``scratch / <name>-<dtype>`` (written once; reused while it exists)."""
    if transformers_unreadable(model_dir) is None:
        return model_dir
    from aegaeon_market.hf_import import convert_hf, read_hf_dir

    out = scratch / f"{model_dir.name}-{dtype}"
    if (out / "config.json").is_file():
        return out
    staging = scratch / f".{out.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        convert_hf(read_hf_dir(model_dir), staging, dtype)
        staging.rename(out)  # whole or absent
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
