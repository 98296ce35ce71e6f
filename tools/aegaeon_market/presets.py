"""Real architectures at real sizes, with random weights: ``market add --random PRESET``.

A preset is a released model's ``config.json`` (sizes, vocabulary size, tied
embeddings, rope and its scaling, norm epsilon, biases or q/k norms, special
ids) over the market's conventions for its family: the tokenizer is the
family's, trained on the shipped corpus, with its special tokens at their
released ids, so every id it yields is below ``vocab_size``. Speed and
switching are then measured at real scale without a download.
`preset_writer` writes the files; this module is torch-free, so parameter
counts come from shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from aegaeon_common.market_index import MarketError

from aegaeon_market.families import LLAMA3_VOCAB, MISTRAL_VOCAB, QWEN_VOCAB, Vocab
from aegaeon_market.hfconfig import config_json
from aegaeon_market.ladder import Recipe, Rope
from aegaeon_market.shapes import param_count

PRESET_DTYPE = "bfloat16"  # as the releases are stored


def _real(vocab: Vocab, size: int, back_start: int | None = None) -> Vocab:
    """``vocab``'s trained tokens and specials in a released vocabulary of ``size`` ids."""
    return replace(vocab, size=size, learned=vocab.num_learned, back_start=back_start)


# Llama 3's specials are ids 128000-128255, Qwen's 151643-..., Mistral v0.3's 0-770
# (the first eight are ours too); Qwen pads its embedding beyond the tokenizer.
_LLAMA3 = _real(LLAMA3_VOCAB, 128_256, back_start=128_000)
_QWEN = _real(QWEN_VOCAB, 151_936, back_start=151_643)
_QWEN_7B = _real(QWEN_VOCAB, 152_064, back_start=151_643)
_MISTRAL = _real(MISTRAL_VOCAB, 32_768)

_LLAMA32_ROPE = Rope(theta=500_000.0, max_positions=131_072, llama3_factor=32.0,
                     original_max_positions=8192)
_LLAMA31_ROPE = replace(_LLAMA32_ROPE, llama3_factor=8.0)
_QWEN25_ROPE = Rope(theta=1_000_000.0, max_positions=32_768)


@dataclass(frozen=True)
class Preset:
    """One released model: its sizes as a `Recipe` and the config keys that differ
    from what `hfconfig.config_json` writes for its family."""

    name: str
    recipe: Recipe
    config_overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def params(self) -> int:
        """Parameters, tied embeddings counted once (as the release's count)."""
        return param_count(self.recipe)

    @property
    def architecture(self) -> str:
        return self.recipe.family_spec.architecture

    @property
    def source(self) -> str:
        """The ``source`` of its market entry."""
        return f"random (preset {self.name})"


def _preset(name: str, family: str, vocab: Vocab, *, hidden: int, layers: int, heads: int,
            kv_heads: int, intermediate: int, tied: bool, rope: Rope, head_dim: int = 0,
            **overrides: Any) -> Preset:
    recipe = Recipe(name, family, hidden_size=hidden, num_layers=layers, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
                    intermediate_size=intermediate, tie_embeddings=tied, rope=rope,
                    vocab=vocab)
    return Preset(name, recipe, tuple(sorted(overrides.items())))


# Sizes as the instruct releases' config.json give them (base and instruct share sizes).
PRESETS: dict[str, Preset] = {p.name: p for p in (
    _preset("qwen2.5-0.5b", "qwen2", _QWEN, hidden=896, layers=24, heads=14, kv_heads=2,
            intermediate=4864, tied=True, rope=_QWEN25_ROPE, eos_token_id=151_645,
            sliding_window=32_768, max_window_layers=21),
    _preset("qwen2.5-1.5b", "qwen2", _QWEN, hidden=1536, layers=28, heads=12, kv_heads=2,
            intermediate=8960, tied=True, rope=_QWEN25_ROPE, eos_token_id=151_645,
            sliding_window=32_768, max_window_layers=21),
    _preset("qwen2.5-7b", "qwen2", _QWEN_7B, hidden=3584, layers=28, heads=28, kv_heads=4,
            intermediate=18_944, tied=False, rope=_QWEN25_ROPE, eos_token_id=151_645,
            sliding_window=131_072, max_window_layers=28),
    _preset("llama-3.2-1b", "llama", _LLAMA3, hidden=2048, layers=16, heads=32, kv_heads=8,
            intermediate=8192, tied=True, rope=_LLAMA32_ROPE, head_dim=64),
    _preset("llama-3.2-3b", "llama", _LLAMA3, hidden=3072, layers=28, heads=24, kv_heads=8,
            intermediate=8192, tied=True, rope=_LLAMA32_ROPE, head_dim=128),
    _preset("llama-3.1-8b", "llama", _LLAMA3, hidden=4096, layers=32, heads=32, kv_heads=8,
            intermediate=14_336, tied=False, rope=_LLAMA31_ROPE),
    _preset("qwen3-8b", "qwen3", _QWEN, hidden=4096, layers=36, heads=32, kv_heads=8,
            intermediate=12_288, tied=False, head_dim=128,
            rope=Rope(theta=1_000_000.0, max_positions=40_960), eos_token_id=151_645),
    _preset("mistral-7b-v0.3", "mistral", _MISTRAL, hidden=4096, layers=32, heads=32,
            kv_heads=8, intermediate=14_336, tied=False,
            rope=Rope(theta=1_000_000.0, max_positions=32_768)),
)}


def preset_named(name: str) -> Preset:
    """The preset called ``name``; `MarketError` naming the known ones otherwise."""
    if name not in PRESETS:
        raise MarketError(f"--random {name!r}: unknown preset; known presets: "
                          f"{', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(preset: Preset, dtype: str) -> dict[str, Any]:
    """The preset's ``config.json`` with weights stored in ``dtype``."""
    return {**config_json(preset.recipe, dtype), **dict(preset.config_overrides)}
