"""The files of an imported model directory, and the tensors a spec needs.

Both importers (Hugging Face directory, GGUF file) end here: the JSON files,
``tokenizer.json`` and one ``model.safetensors`` written tensor by tensor in
the serving dtype. The tensors are exactly those the engine's packed layout
reads (`expected_tensors`), so a checkpoint's extras (a tied ``lm_head``, old
``rotary_emb.inv_freq`` buffers) are not copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from aegaeon_engine.layout import weight_layout
from aegaeon_engine.spec import QUANT_BLOCKS, ModelSpec

from aegaeon_market.safetensors_out import SafetensorsWriter, TensorPlan
from aegaeon_market.writer import write_json

WEIGHTS_FILE = "model.safetensors"


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the engine reads for ``spec``, with its HF shape, in layout
    order."""
    out: dict[str, tuple[int, ...]] = {}
    for slot in weight_layout(spec, "float32").slots:
        for name, shape in zip(slot.sources, slot.source_shapes(), strict=True):
            out[name] = shape
    return out


def kept_blocks(spec: ModelSpec) -> dict[str, str]:
    """The tensors a GGUF import kept in their blocks (``spec.quant``, stored as U8
    ``[rows, row_bytes]``), each with its quantization (``q4_1``); empty for a float or
    FP8 checkpoint."""
    if spec.quant is None or spec.quant.linear not in QUANT_BLOCKS:
        return {}
    return {name: slot.dtype for slot in weight_layout(spec, spec.dtype).slots
            if slot.dtype in QUANT_BLOCKS for name in slot.sources}


def write_model_files(out: Path, *, config: dict[str, Any], generation: dict[str, Any] | None,
                      tokenizer_json: str, tokenizer_config: dict[str, Any],
                      plans: list[TensorPlan],
                      tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write a model directory into ``out`` (created if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    with SafetensorsWriter(out / WEIGHTS_FILE, plans) as writer:
        for name, tensor in tensors:
            writer.write(name, tensor)
    write_json(out / "config.json", config)
    if generation is not None:
        write_json(out / "generation_config.json", generation)
    (out / "tokenizer.json").write_text(tokenizer_json + "\n", encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config)
