"""Model and KV-cache specs parsed from a checkpoint's JSON files.

Pure (no torch): a cache process plans layouts and KV shapes without importing
the tensor library. Every architecture served here is a Llama-family decoder;
the differences between families are a handful of flags (biases, q/k norm,
tied embeddings) looked up in ``ARCHITECTURES``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aegaeon_common.dtypes import (
    DTYPE_BYTES,
    FP8,
    QUANT_BLOCKS,
    canonical_dtype,
    quant_matrix_bytes,
    quant_row_bytes,
)

from .errors import CheckpointError

__all__ = ["DTYPE_BYTES", "FP8", "QUANT_BLOCKS", "ArchTraits", "KVShape", "ModelSpec", "QuantSpec",
           "RopeSpec", "canonical_dtype", "quant_matrix_bytes", "quant_row_bytes"]


@dataclass(frozen=True)
class ArchTraits:
    """How one architecture differs from plain Llama."""

    qkv_bias: str | bool  # a config key holding the flag, or a constant
    o_bias: str | bool
    qk_norm: bool


# config.json ``model_type`` -> architecture, for configs without ``architectures``
# (e.g. ones written from a GGUF file's metadata)
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
}

ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits(qkv_bias="attention_bias", o_bias="attention_bias",
                                   qk_norm=False),
    "MistralForCausalLM": ArchTraits(qkv_bias=False, o_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": ArchTraits(qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": ArchTraits(qkv_bias="attention_bias", o_bias="attention_bias",
                                   qk_norm=True),
}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters; ``kind`` is ``default``, ``linear`` or ``llama3``."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class QuantSpec:
    """A quantization kept in the served weights, from ``config.json``'s
    ``quantization_config``: GGUF blocks (``quant_method: gguf``, ``QUANT_BLOCKS``) or
    FP8 e4m3 with per-output-row scales (``FP8``: ``compressed-tensors`` float 8-bit
    weights by channel or tensor, or ``fp8`` without blocks). ``linear`` for every
    layer projection; ``embed_tokens`` and ``lm_head`` their own type, or None for
    float (the model's dtype; always for FP8). Norms and biases are always float."""

    linear: str
    embed_tokens: str | None = None
    lm_head: str | None = None


@dataclass(frozen=True)
class KVShape:
    """The shape of one model's paged KV cache.

    A block holds K and V of every layer for ``block_size`` positions; other
    rooms treat it as ``block_bytes`` opaque bytes (docs/interfaces.md). The
    engine's intra-block layout is ``[num_layers, 2, block_size, num_kv_heads,
    head_dim]``, so gathering a layer's K of several blocks is one index_select
    that yields ``[tokens, heads, dim]`` rows.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_numel(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.itemsize

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model, from its JSON files."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_model_len: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quant: QuantSpec | None = None  # block-quantized matrices (CPU); None: all float

    @property
    def weight_dtype(self) -> str:
        """What the matrices are stored in: the quantization (``q4_1``), else ``dtype``."""
        return self.quant.linear if self.quant is not None else self.dtype

    @property
    def q_size(self) -> int:  # rows of q in the fused qkv projection
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # rows of k (and of v)
        return self.num_kv_heads * self.head_dim

    def kv_shape(self, dtype: str | None = None, block_size: int = 16) -> KVShape:
        """The KV shape when serving in ``dtype`` (default: the checkpoint's)."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, block_size,
                       canonical_dtype(dtype or self.dtype))

    @classmethod
    def from_dir(cls, path: str | Path, max_model_len: int | None = None) -> ModelSpec:
        """Parse ``config.json`` (+ ``generation_config.json`` when present).

        ``max_model_len`` caps the serving window below ``max_position_embeddings``
        (e.g. to serve a sliding-window model only where the window never slides).
        Raises ``CheckpointError`` naming the file and field at fault.
        """
        root = Path(path)
        config = read_json_object(root / "config.json")
        if config is None:
            raise CheckpointError(root / "config.json", None, "missing file")
        generation = read_json_object(root / "generation_config.json")
        return cls.from_config(config, generation, name=root.name,
                               source=root / "config.json", max_model_len=max_model_len)

    @classmethod
    def from_config(cls, config: dict[str, Any], generation: dict[str, Any] | None = None, *,
                    name: str = "model", source: str | Path = "config.json",
                    max_model_len: int | None = None) -> ModelSpec:
        """Build a spec from already-parsed config dicts (see ``from_dir``)."""
        cfg = _Fields(config, source)
        arch = _architecture(cfg)
        traits = ARCHITECTURES[arch]
        act = cfg.get("hidden_act", str, "silu")
        if act != "silu":
            raise CheckpointError(source, "hidden_act", f"{act!r} is not supported (only silu)")
        if cfg.get("mlp_bias", bool, False):
            raise CheckpointError(source, "mlp_bias", "MLP biases are not supported")
        hidden = cfg.get("hidden_size", int)
        num_heads = cfg.get("num_attention_heads", int)
        num_kv_heads = cfg.get("num_key_value_heads", int, num_heads)
        head_dim = cfg.get("head_dim", int, None) or hidden // num_heads
        if num_heads % num_kv_heads:
            raise CheckpointError(source, "num_key_value_heads",
                                  f"{num_kv_heads} does not divide {num_heads} heads")
        if head_dim % 2:
            raise CheckpointError(source, "head_dim", f"{head_dim} is odd (rotary needs pairs)")
        max_pos = cfg.get("max_position_embeddings", int)
        window = max_pos if max_model_len is None else min(max_pos, max_model_len)
        _check_sliding_window(cfg, arch, window)
        gen = _Fields(generation or {}, Path(source).with_name("generation_config.json"))
        eos_src = gen if gen.get("eos_token_id", object, None) is not None else cfg
        bos_src = gen if gen.get("bos_token_id", object, None) is not None else cfg
        dtype = cfg.get("dtype", str, None) or cfg.get("torch_dtype", str, "float32")
        try:
            dtype = canonical_dtype(dtype)
        except ValueError as exc:
            raise CheckpointError(source, "dtype", str(exc)) from None

        def flag(value: str | bool) -> bool:
            return value if isinstance(value, bool) else bool(cfg.get(value, bool, False))

        return cls(
            name=name, architecture=arch,
            vocab_size=cfg.get("vocab_size", int), hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", int),
            num_layers=cfg.get("num_hidden_layers", int),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", float, 1e-6)),
            rope=_parse_rope(cfg), max_model_len=window,
            tie_word_embeddings=cfg.get("tie_word_embeddings", bool, False),
            qkv_bias=flag(traits.qkv_bias), o_bias=flag(traits.o_bias),
            qk_norm=traits.qk_norm, dtype=dtype,
            eos_token_ids=_token_ids(eos_src, "eos_token_id"),
            bos_token_id=next(iter(_token_ids(bos_src, "bos_token_id")), None),
            quant=_parse_quant(cfg),
        )


class _Fields:
    """Typed access to a JSON object that reports the file and key on error."""

    def __init__(self, data: dict[str, Any], source: str | Path) -> None:
        self.data, self.source = data, source

    _MISSING: Any = object()

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is _Fields._MISSING:
                raise CheckpointError(self.source, key, "missing")
            return default
        value = self.data[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise CheckpointError(self.source, key,
                                  f"expected {kind.__name__}, got {value!r}")
        if kind is int and value <= 0 and key not in ("bos_token_id", "eos_token_id"):
            raise CheckpointError(self.source, key, f"must be positive, got {value}")
        return value


def _architecture(cfg: _Fields) -> str:
    """The served architecture: from ``architectures``, else from ``model_type``."""
    archs = cfg.get("architectures", list, None)
    if archs is None:
        model_type = cfg.get("model_type", str, None)
        if model_type is None:
            raise CheckpointError(cfg.source, "architectures", "missing (and no model_type)")
        if model_type not in MODEL_TYPES:
            raise CheckpointError(cfg.source, "model_type",
                                  f"unsupported model type {model_type!r}; "
                                  f"supported: {sorted(MODEL_TYPES)}")
        return MODEL_TYPES[model_type]
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(cfg.source, "architectures",
                              f"unsupported architecture {archs!r}; "
                              f"supported: {sorted(ARCHITECTURES)}")
    return str(arch)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, None, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, None, "top level is not a JSON object")
    return data


def _token_ids(fields: _Fields, key: str) -> tuple[int, ...]:
    value = fields.get(key, object, None)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise CheckpointError(fields.source, key, f"expected a token id or a list, got {value!r}")
    return tuple(dict.fromkeys(items))


def _parse_fp8(raw: dict[str, Any], method: str, source: str | Path) -> QuantSpec:
    """FP8 weights (``QuantSpec``'s docstring); anything else under these methods is
    refused, naming the field."""
    key = "quantization_config"
    if method == "fp8":
        if raw.get("weight_block_size") is not None:
            raise CheckpointError(source, f"{key}.weight_block_size", "block-wise FP8 scales "
                                  "are not supported (per-channel or per-tensor)")
        return QuantSpec(FP8)
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(source, f"{key}.config_groups", "missing or empty")
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        where = f"{key}.config_groups.{group_name}.weights"
        if not isinstance(weights, dict):
            raise CheckpointError(source, where, "missing")
        kind = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"))
        if kind[:2] != (8, "float") or kind[2] not in ("channel", "tensor"):
            raise CheckpointError(source, where, f"{kind} is not supported (8-bit float "
                                  "weights by channel or tensor)")
    ignored = raw.get("ignore") or []
    if not any(str(name).endswith("lm_head") for name in ignored):
        raise CheckpointError(source, f"{key}.ignore", "an FP8 lm_head is not supported "
                              "(it must be listed in ignore)")
    return QuantSpec(FP8)


def _parse_quant(cfg: _Fields) -> QuantSpec | None:
    """``quantization_config`` of a GGUF import or an FP8 checkpoint (``QuantSpec``);
    other methods are refused."""
    raw = cfg.get("quantization_config", dict, None)
    if raw is None:
        return None
    sub = _Fields(raw, cfg.source)
    method = sub.get("quant_method", str)
    if method in ("compressed-tensors", "fp8"):
        return _parse_fp8(raw, method, cfg.source)
    if method != "gguf":
        raise CheckpointError(cfg.source, "quantization_config.quant_method",
                              f"{method!r} is not supported (gguf, compressed-tensors, fp8)")

    def qtype(key: str, default: str | None) -> str | None:
        name: str | None = sub.get(key, str, default)
        if name is not None and name not in QUANT_BLOCKS:
            raise CheckpointError(cfg.source, f"quantization_config.{key}",
                                  f"{name!r} is not one of {sorted(QUANT_BLOCKS)}")
        return name

    linear = qtype("linear", None)
    if linear is None:
        raise CheckpointError(cfg.source, "quantization_config.linear", "missing")
    return QuantSpec(linear, qtype("embed_tokens", None), qtype("lm_head", None))


def _parse_rope(cfg: _Fields) -> RopeSpec:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x writes
    # "rope_theta" at top level and an optional "rope_scaling".
    params = cfg.get("rope_parameters", dict, None)
    key = "rope_parameters"
    if params is None:
        params = dict(cfg.get("rope_scaling", dict, None) or {})
        key = "rope_scaling"
        params.setdefault("rope_theta", cfg.get("rope_theta", float, 10000.0))
    sub = _Fields(params, cfg.source)
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(sub.get("rope_theta", float, cfg.get("rope_theta", float, 10000.0)))
    if kind == "default":
        return RopeSpec(theta)
    if kind == "linear":
        return RopeSpec(theta, "linear", factor=float(sub.get("factor", float)))
    if kind == "llama3":
        return RopeSpec(theta, "llama3", factor=float(sub.get("factor", float)),
                        low_freq_factor=float(sub.get("low_freq_factor", float)),
                        high_freq_factor=float(sub.get("high_freq_factor", float)),
                        original_max_position=sub.get("original_max_position_embeddings", int))
    raise CheckpointError(cfg.source, f"{key}.rope_type",
                          f"rope type {kind!r} is not supported (default, linear, llama3)")


def _check_sliding_window(cfg: _Fields, arch: str, window: int) -> None:
    """Refuse a sliding window that could slide within the serving window.

    The engine attends over the whole context; that equals sliding-window
    attention only while the context is no longer than the window.
    """
    sliding = cfg.get("sliding_window", int, None)
    if sliding is None:
        return
    if arch.startswith("Qwen"):
        layer_types = cfg.get("layer_types", list, [])
        used = cfg.get("use_sliding_window", bool, False) or "sliding_attention" in layer_types
        if not used:
            return
    if sliding < window:
        raise CheckpointError(cfg.source, "sliding_window",
                              f"sliding window of {sliding} tokens is smaller than the "
                              f"serving window of {window}; sliding-window attention is not "
                              f"supported (serve with max_model_len <= {sliding})")
