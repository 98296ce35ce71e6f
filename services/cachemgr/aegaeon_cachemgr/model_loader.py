"""The engine-facing half of the Model Cache: plan a model's region, fill it from disk.

The region's layout is the engine's packed ``weight_layout`` in the serving
dtype, so a worker's scale-up is one flat copy of the region (paper §5.2).
Every checkpoint defect surfaces as ``CacheError("checkpoint_error")``.
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
    adapter: AdapterSpec | None = None  # a LoRA adapter's region (lora_spec's layout)


def checkpoint_failure(exc: CheckpointError) -> CacheError:
    detail: dict[str, int | float | str] = {"path": exc.path, "reason": exc.reason}
    if exc.field:
        detail["field"] = exc.field
    return CacheError("checkpoint_error", str(exc), detail)


def plan_model(name: str, path: Path, dtype: str, base: Path | None = None) -> ModelPlan:
    """Read the model's JSON files (cheap, no tensor data) and lay it out in ``dtype``;
    with ``base`` (its base's checkpoint), ``path`` is a LoRA adapter of it, checked
    against the base's shapes (its safetensors header)."""
    adapter = None
    try:
        if base is None:
            layout = weight_layout(ModelSpec.from_dir(path), dtype)
        else:
            adapter = AdapterSpec.from_dir(path, ModelSpec.from_dir(base), name)
            layout = adapter_layout(adapter, dtype)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None
    tensors = [
        TensorEntry(s.name, s.dtype, list(s.shape), s.offset, s.nbytes) for s in layout.slots
    ]
    return ModelPlan(name, path, layout.dtype, layout.total_bytes, tensors, layout, adapter)


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
        return fill_layout(plan.path, plan.layout, dest, progress, digests)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None
