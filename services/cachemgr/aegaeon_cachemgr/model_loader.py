"""The engine-facing half of the Model Cache: plan a model's region, fill it from disk.

The region's layout is the engine's packed ``weight_layout`` in the serving
dtype, so a worker's scale-up is one flat copy of the region (paper §5.2).
With tensor-parallel instances (``tp`` > 1) a model that splits ``tp`` ways is
held as its shards back to back (``TPLayout``): each rank of a group copies
its own contiguous range, all ranks at once; one that does not split is held
whole (its group runs it on its first device). Every checkpoint defect
surfaces as ``CacheError("checkpoint_error")``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from aegaeon_common.messages.cache import TensorEntry
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.layout import WeightLayout, weight_layout
from aegaeon_engine.loader import check_checkpoint, fill_layout
from aegaeon_engine.lora_spec import AdapterSpec, adapter_layout
from aegaeon_engine.spec import ModelSpec
from aegaeon_engine.tp import fill_tp_layout
from aegaeon_engine.tp_layout import TPLayout, sharded_layout

from aegaeon_cachemgr.errors import CacheError


@dataclass(frozen=True)
class ModelPlan:
    """What a model's region holds: ``nbytes`` in ``dtype`` with this manifest."""

    name: str
    path: Path
    dtype: str
    nbytes: int
    tensors: list[TensorEntry]
    layout: WeightLayout
    # the shards, when the region holds the model split for tensor-parallel instances
    shards: TPLayout | None = None
    spec: ModelSpec | None = None
    adapter: AdapterSpec | None = None  # a LoRA adapter's region (lora_spec's layout)


def checkpoint_failure(exc: CheckpointError) -> CacheError:
    detail: dict[str, int | float | str] = {"path": exc.path, "reason": exc.reason}
    if exc.field:
        detail["field"] = exc.field
    return CacheError("checkpoint_error", str(exc), detail)


def plan_model(name: str, path: Path, dtype: str, tp: int = 1,
               base: Path | None = None) -> ModelPlan:
    """Read the model's JSON files (cheap, no tensor data) and lay it out in ``dtype``,
    split ``tp`` ways where it splits (the manifest then names rank r's tensors
    ``rank<r>/<name>``, at their offsets in the region). With ``base`` (its base's
    checkpoint), ``path`` is a LoRA adapter of it, checked against the base's shapes (its
    safetensors header), and held whole (adapters are not served on shards)."""
    try:
        spec = ModelSpec.from_dir(path if base is None else base)
        adapter = None if base is None else AdapterSpec.from_dir(path, spec, name)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None
    if adapter is not None:
        layout = adapter_layout(adapter, dtype)
        return ModelPlan(name, path, layout.dtype, layout.total_bytes, _manifest(layout), layout,
                         adapter=adapter)  # fmt: skip
    layout = weight_layout(spec, dtype)
    shards = sharded_layout(spec, tp, dtype)
    if shards is None:
        return ModelPlan(name, path, layout.dtype, layout.total_bytes, _manifest(layout), layout)
    tensors = [entry for r, shard in enumerate(shards.shards)
               for entry in _manifest(shard, f"rank{r}/", shards.offsets[r])]  # fmt: skip
    return ModelPlan(name, path, layout.dtype, shards.total_bytes, tensors, layout, shards, spec)


def _manifest(layout: WeightLayout, prefix: str = "", start: int = 0) -> list[TensorEntry]:
    """``layout``'s tensors as the region's manifest names them (at ``start`` in it)."""
    return [TensorEntry(f"{prefix}{s.name}", s.dtype, list(s.shape), start + s.offset, s.nbytes)
            for s in layout.slots]  # fmt: skip


def check_plan(plan: ModelPlan) -> None:
    """The checkpoint's headers against the plan (names, shapes, dtypes, every tensor's
    bytes inside its file): what a load would refuse before reading any data."""
    if plan.adapter is not None:
        return  # a LoRA adapter's header was checked against its base as it was planned
    try:
        check_checkpoint(plan.path, plan.layout)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None


def fill_region(
    plan: ModelPlan, dest: torch.Tensor, progress: Callable[[int], None] | None = None,
    digests: Mapping[Path, str] | None = None,
) -> set[Path]:
    """Read the checkpoint into ``dest`` (runs on a loader thread, off the event loop);
    ``progress`` is told the bytes filled so far; the files with ``digests`` are hashed
    as they are read (a changed one is a ``checkpoint_error``). Returns the files read."""
    try:
        if plan.adapter is not None:
            from aegaeon_engine.lora import fill_adapter

            read = fill_adapter(plan.path, plan.adapter, plan.layout, dest, digests)
            if progress is not None:
                progress(plan.nbytes)
            return read
        if plan.shards is not None:  # its files' digests are then checked on their own
            assert plan.spec is not None
            fill_tp_layout(plan.path, plan.spec, plan.shards, dest, progress)
            return set()
        return fill_layout(plan.path, plan.layout, dest, progress, digests)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None
