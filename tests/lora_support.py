"""LoRA adapters made by ``peft`` (the oracle) over small transformers checkpoints, and
their references: transformers + PEFT's ``merge_and_unload`` greedy decoding (the
greedy decoding, :func:`greedy_tokens`, the real-model tests' reference too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# (rank, target modules, rsLoRA): the three adapters the tests serve
ADAPTERS: tuple[tuple[int, tuple[str, ...], bool], ...] = (
    (8, ("q_proj", "v_proj"), False),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj"), True),
    (64, ("o_proj", "gate_proj", "up_proj", "down_proj"), False),
)


@dataclass(frozen=True)
class PeftAdapter:
    path: Path
    rank: int
    targets: tuple[str, ...]
    rslora: bool


def make_peft_adapter(base_dir: Path, out: Path, rank: int, targets: Sequence[str],
                      rslora: bool = False, seed: int = 0,
                      alpha: float | None = None) -> PeftAdapter:
    """A random LoRA adapter of the checkpoint in ``base_dir``, saved by ``peft``: both A
    and B random (``init_lora_weights=False``), so it changes what the model says."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(targets), use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return PeftAdapter(out, rank, tuple(targets), rslora)


def greedy_tokens(model: Any, prompts: Sequence[Sequence[int]],
                  num_tokens: int) -> list[list[int]]:
    """transformers' greedy decoding of ``prompts`` side by side in one batch (left-padded,
    the padding masked out), EOS taken like any token (as ``ignore_eos`` serves)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=num_tokens, eos_token_id=None,
                              pad_token_id=0)
    model.generation_config.eos_token_id = None  # else generate() takes the model's and stops
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return [[int(t) for t in row] for row in out[:, width:]]


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: Sequence[Sequence[int]],
                num_tokens: int) -> list[list[int]]:
    """transformers + PEFT (merged into the weights) greedy in float32, EOS taken like any
    token; the base alone when ``adapter_dir`` is None."""
    return peft_references(base_dir, {"": adapter_dir}, prompts, num_tokens)[""]


def peft_references(base_dir: Path, adapters: dict[str, Path | None],
                    prompts: Sequence[Sequence[int]],
                    num_tokens: int) -> dict[str, list[list[int]]]:  # fmt: skip
    """:func:`peft_greedy` for each adapter (name -> its directory, None: the base alone),
    the base read once."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    out: dict[str, list[list[int]]] = {}
    for name, adapter_dir in adapters.items():
        model = base
        if adapter_dir is not None:  # merging changes the weights: a copy of the base
            model = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir)
            model = model.merge_and_unload().eval()
        out[name] = greedy_tokens(model, prompts, num_tokens)
    return out


def lora_market(root: Path, bases: dict[str, Path]) -> Path:
    """A market in ``root`` whose models are ``bases`` (name -> checkpoint directory,
    linked in, not copied: a test adds adapters to it without touching the shared
    markets those checkpoints live in)."""
    from aegaeon_common.market_index import Manifest, MarketEntry
    from aegaeon_engine import ModelSpec
    from aegaeon_market.manifest import write_manifest

    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, path in bases.items():
        (root / name).symlink_to(path.resolve(), target_is_directory=True)
        spec = ModelSpec.from_dir(path)
        entries.append(MarketEntry(name, root / name, spec.architecture, 0, spec.dtype,
                                   source=str(path)))
    write_manifest(root, Manifest(0, "", "", tuple(entries)))
    return root
