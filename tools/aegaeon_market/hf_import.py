"""Import a Hugging Face checkpoint directory into a market's layout.

The source is checked whole before anything is written: ``config.json`` and
``generation_config.json`` through the engine's `ModelSpec` (architecture,
rope scaling, dtypes, special ids), ``tokenizer.json`` loads and fits the
vocabulary, every tensor the engine reads is present (single file or shards +
index) with the shape the config implies. The copy holds those tensors in the
serving dtype in one ``model.safetensors``, ``config.json`` with that dtype,
and the text files verbatim (tokenizer, its config, the chat template).

FP8 (``float8_e4m3fn``): a float source's projections are quantized per output
row (fp8_out.py); an FP8 source (``quantization_config`` of compressed-tensors
with 8-bit float weights, or ``fp8`` without blocks, each projection's
``weight_scale`` per row or per tensor) is read as its dequantized values, so
it converts to any dtype, and to FP8 again with per-row scales.

GGUF blocks (a market model imported from a GGUF file with its Q8_0/Q4_0/Q4_1
matrices kept, ``quantization_config.quant_method: gguf``, the blocks as U8
``[rows, row_bytes]``): copied as they are by default, or dequantized by the
``gguf`` package into a float dtype or FP8, so any market model can be had in
float weights (what transformers reads, `aegaeon_market.readable`).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.fp8 import dequantize
from aegaeon_engine.loader import checkpoint_index, read_tensor, scale_name
from aegaeon_engine.spec import FP8, ModelSpec, quant_row_bytes, read_json_object
from aegaeon_engine.st_header import TensorEntry
from aegaeon_engine.weights import TORCH_DTYPES
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as dequantize_blocks
from tokenizers import Tokenizer

from aegaeon_market.fp8_out import fp8_config, fp8_plans, fp8_tensors, is_projection
from aegaeon_market.model_files import expected_tensors, kept_blocks, write_model_files
from aegaeon_market.safetensors_out import TensorPlan

# copied as they are when present (tokenizer.json and tokenizer_config.json are read)
TEXT_FILES = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json")


@dataclass(frozen=True)
class HFModel:
    """A checked Hugging Face directory."""

    root: Path
    config: dict[str, Any]
    spec: ModelSpec
    tensors: dict[str, TensorEntry]  # the tensors the engine reads, in layout order
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    scales: dict[str, TensorEntry] = field(default_factory=dict)  # FP8 weight -> its scales
    blocks: dict[str, str] = field(default_factory=dict)  # GGUF blocks kept -> quantization

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in expected_tensors(self.spec).values())


def _tokenizer(root: Path, spec: ModelSpec) -> tuple[str, dict[str, Any]]:
    path = root / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(path, None, "missing file (only fast tokenizers are supported)")
    text = path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises bare Exceptions
        raise CheckpointError(path, None, f"unreadable tokenizer ({exc})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > spec.vocab_size:
        raise CheckpointError(path, "model.vocab", f"{size} token ids, more than config.json's "
                              f"vocab_size of {spec.vocab_size}")
    config = read_json_object(root / "tokenizer_config.json") or {}
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str | list):
        raise CheckpointError(root / "tokenizer_config.json", "chat_template",
                              f"expected a string or a list, got {type(template).__name__}")
    return text, config


def read_hf_dir(root: Path) -> HFModel:
    """Check ``root`` as a servable checkpoint; `CheckpointError` names what is wrong."""
    if not root.is_dir():
        raise CheckpointError(root, None, "not a directory")
    spec = ModelSpec.from_dir(root)
    config = read_json_object(root / "config.json")
    assert config is not None  # from_dir refused a missing one
    quantization = config.get("quantization_config")
    fp8_source = spec.quant is not None and spec.quant.linear == FP8
    blocks = kept_blocks(spec)
    if quantization and not fp8_source and not blocks:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise CheckpointError(root / "config.json", "quantization_config",
                              f"quantized checkpoints ({method or 'unknown method'}) are not "
                              "supported; import the GGUF file or a float checkpoint")
    text, tokenizer_config = _tokenizer(root, spec)
    index = checkpoint_index(root)
    tensors: dict[str, TensorEntry] = {}
    scales: dict[str, TensorEntry] = {}
    for name, logical in expected_tensors(spec).items():
        entry = index.get(name)
        if entry is None:
            raise CheckpointError(root / "model.safetensors", name, "missing tensor")
        qtype = blocks.get(name)
        shape = (logical if qtype is None  # else rows of GGUF blocks
                 else (logical[0], quant_row_bytes(qtype, logical[1])))
        if entry.shape != shape:
            raise CheckpointError(entry.file, name, f"shape {list(entry.shape)} disagrees with "
                                  f"config.json (expected {list(shape)})")
        if qtype is not None:
            if entry.code != "U8":
                raise CheckpointError(entry.file, name, f"dtype {entry.code}: {qtype} blocks "
                                      "are stored as U8")
        elif fp8_source and is_projection(name):
            scales[name] = _fp8_scales(root, index, name, entry)
        elif entry.code not in ("F32", "BF16", "F16", "F64"):
            raise CheckpointError(entry.file, name, f"dtype {entry.code}: only float tensors "
                                  "load (quantized safetensors are not supported)")
        tensors[name] = entry
    return HFModel(root, config, spec, tensors, text, tokenizer_config, scales, blocks)


def _fp8_scales(root: Path, index: dict[str, TensorEntry], name: str,
                entry: TensorEntry) -> TensorEntry:
    """The scales of FP8 weight ``name`` (checked: F8_E4M3 codes, one scale per row or
    one per tensor)."""
    if entry.code != "F8_E4M3":
        raise CheckpointError(entry.file, name, f"dtype {entry.code}: an FP8 checkpoint's "
                              "projections are F8_E4M3")
    scale = index.get(scale_name(name))
    if scale is None:
        raise CheckpointError(root / "model.safetensors", scale_name(name), "missing tensor")
    rows = entry.shape[0]
    if scale.shape not in ((), (1,), (rows,), (rows, 1)):
        raise CheckpointError(scale.file, scale_name(name), f"shape {list(scale.shape)}: "
                              f"expected [{rows}, 1] (per row) or [] (per tensor)")
    return scale


def _values(model: HFModel, name: str, entry: TensorEntry) -> torch.Tensor:
    """Tensor ``name``'s values: as stored, or an FP8 weight's or GGUF blocks' dequantized
    (float32)."""
    qtype = model.blocks.get(name)
    if qtype is not None:
        raw = read_tensor(entry, name, blocks=True).numpy()
        values = dequantize_blocks(raw, GGMLQuantizationType[qtype.upper()])
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy, writable
    value = read_tensor(entry, name)
    if name not in model.scales:
        return value
    scale = read_tensor(model.scales[name], scale_name(name)).float().reshape(-1)
    return dequantize(value, scale.expand(value.shape[0]), torch.float32)


def convert_hf(model: HFModel, out: Path, dtype: str,
               progress: Callable[[int], None] | None = None) -> None:
    """Write ``model`` into ``out`` in ``dtype`` (a float dtype, ``FP8``, or the GGUF
    blocks' own quantization: kept as they are; tensors one at a time)."""
    keep = bool(model.blocks) and dtype == model.spec.weight_dtype

    def values() -> Iterator[tuple[str, torch.Tensor]]:
        for name, entry in model.tensors.items():
            kept = keep and name in model.blocks
            yield name, read_tensor(entry, name, blocks=True) if kept else _values(model, name,
                                                                                   entry)
            if progress is not None:
                progress(1)

    logical = expected_tensors(model.spec)  # blocks are stored [rows, row_bytes]
    shapes = [(n, q, e.shape if q else logical[n]) for n, e in model.tensors.items()
              for q in [model.blocks.get(n) if keep else None]]
    tensors: Iterable[tuple[str, torch.Tensor]]
    if keep:  # the blocks as they are, the rest in the float dtype the config names
        target = TORCH_DTYPES[model.spec.dtype]
        plans = [TensorPlan(n, torch.uint8 if q else target, shape) for n, q, shape in shapes]
        tensors = ((n, t if t.dtype == torch.uint8 else t.to(target)) for n, t in values())
        config = dict(model.config)
    elif dtype == FP8:
        plans, tensors = fp8_plans((n, shape) for n, _, shape in shapes), fp8_tensors(values())
        config = fp8_config(model.config)
    else:
        target = TORCH_DTYPES[dtype]
        plans = [TensorPlan(n, target, shape) for n, _, shape in shapes]
        tensors = ((n, t.to(target)) for n, t in values())
        config = {k: v for k, v in model.config.items() if k != "quantization_config"}
        config.update(torch_dtype=dtype, dtype=dtype)
    write_model_files(out, config=config, generation=None, tokenizer_json=model.tokenizer_json,
                      tokenizer_config=model.tokenizer_config, plans=plans, tensors=tensors)
    for name in TEXT_FILES:
        if (model.root / name).is_file():
            shutil.copyfile(model.root / name, out / name)
