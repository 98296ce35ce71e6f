"""Tensor-parallel shards of a model: which rows and columns each rank holds, and the
Model Cache layout that keeps every rank's shard in one contiguous byte range.

Pure (no torch), like ``layout.py``: a cache process plans the shards without
the tensor library.

The split (Megatron's): q/k/v and gate/up are split by output rows (column
parallel), o_proj and down_proj by input columns (row parallel), so a layer
half ends in partial sums that one all-reduce adds up. Heads stay whole:
rank ``r`` of ``T`` holds q heads ``[r Hq/T, (r+1) Hq/T)`` and the kv heads
they read. With fewer kv heads than ranks (``T % Hkv == 0``) each kv head is
replicated on the ``T / Hkv`` ranks whose q heads read it, as a GQA group
never spans a kv head boundary. Embeddings, norms and the output layer are
replicated; the o_proj bias lives on rank 0 only (it is added once, before
the reduce).

A rank's shard is itself a model: ``shard_spec`` is the spec with the rank's
head and intermediate counts, and its ``weight_layout`` is the shard's
layout, so the engine binds and runs a shard like any model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .layout import DEFAULT_ALIGNMENT, Manifest, TensorSlot, WeightLayout, weight_layout
from .spec import ModelSpec, canonical_dtype

# slot name suffix -> the axis of the checkpoint tensor it is split along
_ROW_SPLIT = ("qkv_proj", "qkv_bias", "gate_up_proj")  # by output rows (column parallel)
_COLUMN_SPLIT = ("o_proj", "down_proj")  # by input columns (row parallel)
_PAGE = 4096  # bytes; every shard of a TPLayout starts on a page
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # not yet quantized blocks


def check_tp(spec: ModelSpec, size: int) -> None:
    """Raise ``ValueError`` naming the config field that does not split ``size`` ways."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    fields = {"num_attention_heads": spec.num_heads, "intermediate_size": spec.intermediate_size}
    for field, value in fields.items():
        if value % size:
            raise ValueError(f"{spec.name}: config.json {field}={value} does not split "
                             f"into {size} tensor-parallel shards")
    kv = spec.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"{spec.name}: config.json num_key_value_heads={kv} neither splits "
                         f"into {size} tensor-parallel shards nor divides {size}")


def kv_heads_of(spec: ModelSpec, rank: int, size: int) -> range:
    """The (global) kv heads rank ``rank`` of ``size`` holds."""
    kv = spec.num_kv_heads
    if kv >= size:
        per = kv // size
        return range(rank * per, (rank + 1) * per)
    head = rank // (size // kv)  # replicated: the head this rank's q heads read
    return range(head, head + 1)


def shard_spec(spec: ModelSpec, rank: int, size: int) -> ModelSpec:
    """The spec of rank ``rank``'s shard (``spec`` itself when ``size`` is 1)."""
    check_tp(spec, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    if size == 1:
        return spec
    return replace(spec, num_heads=spec.num_heads // size,
                   num_kv_heads=len(kv_heads_of(spec, rank, size)),
                   intermediate_size=spec.intermediate_size // size,
                   o_bias=spec.o_bias and rank == 0)


@dataclass(frozen=True)
class SourceSlice:
    """Which part of checkpoint tensor ``name`` a shard slot holds: indices
    ``[start, stop)`` along ``axis`` (0: rows, 1: columns); ``axis`` None: all of it."""

    name: str
    axis: int | None
    start: int
    stop: int


def source_slices(spec: ModelSpec, slot: TensorSlot, rank: int, size: int) -> list[SourceSlice]:
    """The checkpoint parts behind ``slot`` of rank ``rank``'s shard layout, in order."""
    kind = slot.name.rsplit(".", 1)[-1]
    out: list[SourceSlice] = []
    for name, rows in zip(slot.sources, slot.source_rows, strict=True):
        if kind in _ROW_SPLIT:
            start = rank * rows
            if ".k_proj." in name or ".v_proj." in name:  # whole heads, maybe replicated
                start = kv_heads_of(spec, rank, size)[0] * spec.head_dim
            out.append(SourceSlice(name, 0, start, start + rows))
        elif kind in _COLUMN_SPLIT:
            cols = slot.shape[1]
            out.append(SourceSlice(name, 1, rank * cols, (rank + 1) * cols))
        else:
            out.append(SourceSlice(name, None, 0, rows))
    return out


@dataclass(frozen=True)
class TPLayout(Manifest):
    """A model split ``size`` ways, as the Model Cache holds it: rank ``r``'s shard is
    the byte range ``[offsets[r], offsets[r] + shards[r].total_bytes)``, laid out as
    ``shards[r]`` (offsets within it start at 0), so each rank copies one range."""

    model: str
    dtype: str
    size: int
    total_bytes: int
    offsets: tuple[int, ...]
    shards: tuple[WeightLayout, ...]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank``'s shard within the cache's range."""
        start = self.offsets[rank]
        return start, start + self.shards[rank].total_bytes


def tp_layout(spec: ModelSpec, size: int, dtype: str | None = None,
              alignment: int = DEFAULT_ALIGNMENT) -> TPLayout:
    """The shards of ``spec`` served ``size`` ways in ``dtype``, back to back.

    Each shard starts on a 4 KiB boundary (a page), so a rank's copy of its
    range starts page-aligned like a single-device model's.
    """
    dtype = canonical_dtype(dtype or spec.dtype)
    quantized = getattr(spec, "quant", None) is not None  # GGUF blocks kept as they are
    if dtype not in _FLOAT_DTYPES or quantized:
        raise ValueError(f"{spec.name}: tensor parallelism serves {', '.join(_FLOAT_DTYPES)} "
                         f"weights, not {'quantized blocks' if quantized else dtype}")
    shards = tuple(weight_layout(shard_spec(spec, r, size), dtype, alignment)
                   for r in range(size))
    offsets: list[int] = []
    offset = 0
    for shard in shards:
        offsets.append(offset)
        offset += -(-shard.total_bytes // _PAGE) * _PAGE
    return TPLayout(spec.name, dtype, size, offset, tuple(offsets), shards)


def sharded_layout(spec: ModelSpec, size: int, dtype: str | None = None) -> TPLayout | None:
    """``spec``'s layout split ``size`` ways, or None when it runs whole on one device
    instead: ``size`` 1, or a model that does not split ``size`` ways (its heads or
    intermediate size, quantized blocks, FP8). A tensor-parallel instance serves
    such a model on its first device alone (``tp_mirror``: the followers idle)."""
    if size <= 1:
        return None
    try:
        return tp_layout(spec, size, dtype)
    except ValueError:
        return None
