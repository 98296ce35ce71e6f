"""Import a Hugging Face checkpoint directory into a market's layout.

The source is checked whole before anything is written: ``config.json`` and
``generation_config.json`` through the engine's `ModelSpec` (architecture,
rope scaling, dtypes, special ids), ``tokenizer.json`` loads and fits the
vocabulary, every tensor the engine reads is present (single file or shards +
index) with the shape the config implies. The copy holds those tensors in the
serving dtype in one ``model.safetensors``, ``config.json`` with that dtype,
and the text files verbatim (tokenizer, its config, the chat template).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.loader import TensorEntry, checkpoint_index, read_tensor
from aegaeon_engine.spec import ModelSpec
from aegaeon_engine.weights import TORCH_DTYPES
from tokenizers import Tokenizer

from aegaeon_market.model_files import expected_tensors, write_model_files
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

    @property
    def params(self) -> int:
        return sum(math.prod(e.shape) for e in self.tensors.values())


def _json_object(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CheckpointError(path, None, "missing file")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, None, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, None, "top level is not a JSON object")
    return data


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
    config = _json_object(root / "tokenizer_config.json", required=False) or {}
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
    config = _json_object(root / "config.json", required=True)
    assert config is not None
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise CheckpointError(root / "config.json", "quantization_config",
                              f"quantized checkpoints ({method or 'unknown method'}) are not "
                              "supported; import the GGUF file or a float checkpoint")
    text, tokenizer_config = _tokenizer(root, spec)
    index = checkpoint_index(root)
    tensors: dict[str, TensorEntry] = {}
    for name, shape in expected_tensors(spec).items():
        entry = index.get(name)
        if entry is None:
            raise CheckpointError(root / "model.safetensors", name, "missing tensor")
        if entry.shape != shape:
            raise CheckpointError(entry.file, name, f"shape {list(entry.shape)} disagrees with "
                                  f"config.json (expected {list(shape)})")
        if entry.code not in ("F32", "BF16", "F16", "F64"):
            raise CheckpointError(entry.file, name, f"dtype {entry.code}: only float tensors "
                                  "load (quantized safetensors are not supported)")
        tensors[name] = entry
    return HFModel(root, config, spec, tensors, text, tokenizer_config)


def convert_hf(model: HFModel, out: Path, dtype: str,
               progress: Callable[[int], None] | None = None) -> None:
    """Write ``model`` into ``out`` in ``dtype`` (tensors one at a time)."""
    target = TORCH_DTYPES[dtype]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, entry in model.tensors.items():
            yield name, read_tensor(entry, name).to(target)
            if progress is not None:
                progress(1)

    plans = [TensorPlan(n, target, e.shape) for n, e in model.tensors.items()]
    config = {**model.config, "torch_dtype": dtype, "dtype": dtype}
    write_model_files(out, config=config, generation=None, tokenizer_json=model.tokenizer_json,
                      tokenizer_config=model.tokenizer_config, plans=plans, tensors=tensors())
    for name in TEXT_FILES:
        if (model.root / name).is_file():
            shutil.copyfile(model.root / name, out / name)
