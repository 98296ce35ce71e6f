"""The packed weight layout: every tensor of a model in one flat byte range.

Pure (no torch). The same layout is the Model Cache's format and the device
buffer's, so switching a model in is one flat byte copy followed by ``bind``.
q/k/v (and gate/up) are placed consecutively along dim 0 in one slot, so the
fused projection is a single matmul over a single view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Self

import msgspec

from .spec import DTYPE_BYTES, ModelSpec, canonical_dtype, quant_matrix_bytes

DEFAULT_ALIGNMENT = 64  # bytes; a cache line, and a multiple of every dtype's size


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of the layout at ``[offset, offset + nbytes)`` of the flat range.

    ``sources`` are the checkpoint tensor names concatenated along dim 0 into
    this slot, with ``source_rows`` rows each (their other dims equal the slot's).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sources: tuple[str, ...]
    source_rows: tuple[int, ...]

    def source_shapes(self) -> list[tuple[int, ...]]:
        """The expected checkpoint shape of each source tensor."""
        return [(rows, *self.shape[1:]) for rows in self.source_rows]


class Manifest:
    """A layout's JSON form, a cache stores beside the bytes (never pickle)."""

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> Self:
        return msgspec.json.decode(text, type=cls)


@dataclass(frozen=True)
class WeightLayout(Manifest):
    """The slots of one model served in one dtype; ``total_bytes`` spans them all."""

    model: str
    dtype: str
    alignment: int
    total_bytes: int
    slots: tuple[TensorSlot, ...] = field(repr=False)

    @cached_property
    def by_name(self) -> dict[str, TensorSlot]:
        return {slot.name: slot for slot in self.slots}

    def slot(self, name: str) -> TensorSlot:
        """The slot called ``name`` (``KeyError`` if absent)."""
        return self.by_name[name]


def weight_layout(spec: ModelSpec, dtype: str | None = None,
                  alignment: int = DEFAULT_ALIGNMENT) -> WeightLayout:
    """The packed layout of ``spec``'s weights when served in ``dtype``.

    A quantized model's (``spec.quant``) matrices keep their block quantization:
    such a slot's ``dtype`` is the quantization (``q4_1``), its ``shape`` the
    logical ``[out, in]``, its bytes whole blocks row after row (GGUF's order); an
    FP8 slot (``float8_e4m3fn``) holds the codes row after row, then the rows' float32
    scales (``aegaeon_common.dtypes.fp8_scales_offset``).

    Slot names: ``embed_tokens``, ``layers.{i}.{input_norm, qkv_proj, qkv_bias,
    q_norm, k_norm, o_proj, o_bias, post_norm, gate_up_proj, down_proj}``,
    ``norm``, ``lm_head`` (absent when embeddings are tied). Optional slots
    exist only when the architecture has them.
    """
    dtype = canonical_dtype(dtype or spec.dtype)
    itemsize = DTYPE_BYTES[dtype]
    if alignment <= 0 or alignment % itemsize:
        raise ValueError(f"alignment {alignment} is not a positive multiple of {itemsize}")
    slots: list[TensorSlot] = []
    offset = 0

    quant = spec.quant

    def add(name: str, tail: tuple[int, ...], sources: list[tuple[str, int]],
            qtype: str | None = None) -> None:
        nonlocal offset
        rows = sum(r for _, r in sources)
        numel = rows
        for dim in tail:
            numel *= dim
        nbytes = numel * itemsize if qtype is None else quant_matrix_bytes(qtype, rows, tail[0])
        slots.append(TensorSlot(name, qtype or dtype, (rows, *tail), offset, nbytes,
                                tuple(s for s, _ in sources), tuple(r for _, r in sources)))
        offset += -(-nbytes // alignment) * alignment

    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    linear = quant.linear if quant else None
    add("embed_tokens", (h,), [("model.embed_tokens.weight", spec.vocab_size)],
        quant.embed_tokens if quant else None)
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        attn = f"{src}.self_attn"
        add(f"{dst}.input_norm", (), [(f"{src}.input_layernorm.weight", h)])
        add(f"{dst}.qkv_proj", (h,), [(f"{attn}.q_proj.weight", q), (f"{attn}.k_proj.weight", kv),
                                      (f"{attn}.v_proj.weight", kv)], linear)
        if spec.qkv_bias:
            add(f"{dst}.qkv_bias", (), [(f"{attn}.q_proj.bias", q), (f"{attn}.k_proj.bias", kv),
                                        (f"{attn}.v_proj.bias", kv)])
        if spec.qk_norm:
            add(f"{dst}.q_norm", (), [(f"{attn}.q_norm.weight", spec.head_dim)])
            add(f"{dst}.k_norm", (), [(f"{attn}.k_norm.weight", spec.head_dim)])
        add(f"{dst}.o_proj", (q,), [(f"{attn}.o_proj.weight", h)], linear)
        if spec.o_bias:
            add(f"{dst}.o_bias", (), [(f"{attn}.o_proj.bias", h)])
        add(f"{dst}.post_norm", (), [(f"{src}.post_attention_layernorm.weight", h)])
        add(f"{dst}.gate_up_proj", (h,), [(f"{src}.mlp.gate_proj.weight", inter),
                                          (f"{src}.mlp.up_proj.weight", inter)], linear)
        add(f"{dst}.down_proj", (inter,), [(f"{src}.mlp.down_proj.weight", h)], linear)
    add("norm", (), [("model.norm.weight", h)])
    if not spec.tie_word_embeddings:
        add("lm_head", (h,), [("lm_head.weight", spec.vocab_size)],
            quant.lm_head if quant else None)
    return WeightLayout(spec.name, dtype, alignment, offset, tuple(slots))
