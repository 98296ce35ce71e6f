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


def checkpoint_failure(exc: CheckpointError) -> CacheError:
    detail: dict[str, int | float | str] = {"path": exc.path, "reason": exc.reason}
    if exc.field:
        detail["field"] = exc.field
    return CacheError("checkpoint_error", str(exc), detail)


def plan_model(name: str, path: Path, dtype: str) -> ModelPlan:
    """Read the model's JSON files (cheap, no tensor data) and lay it out in ``dtype``."""
    try:
        spec = ModelSpec.from_dir(path)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None
    layout = weight_layout(spec, dtype)
    tensors = [
        TensorEntry(s.name, s.dtype, list(s.shape), s.offset, s.nbytes) for s in layout.slots
    ]
    return ModelPlan(name, path, layout.dtype, layout.total_bytes, tensors, layout)


def check_plan(plan: ModelPlan) -> None:
    """The checkpoint's headers against the plan (names, shapes, dtypes, every tensor's
    bytes inside its file): what a load would refuse before reading any data."""
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
        return fill_layout(plan.path, plan.layout, dest, progress, digests)
    except CheckpointError as exc:
        raise checkpoint_failure(exc) from None
