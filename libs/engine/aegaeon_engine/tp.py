"""Tensor parallelism over torch.distributed: a rank's group, its shard's bytes, binding.

One code path for every device: gloo on CPUs, NCCL on CUDA devices, chosen by
the engine's device. Each rank runs the same calls on the same inputs (SPMD):
its engine holds one shard (``tp_layout.shard_spec``) and adds up the partial
outputs of o_proj and down_proj with one all-reduce each per layer, so every
rank ends a layer with the same residual stream and computes the same logits.

A rank reads only its shard: ``fill_shard`` reads the shard's rows and columns
of each checkpoint tensor through a memory map (the row range of a
column-parallel weight is one contiguous read). ``fill_tp_layout`` writes every
shard, back to back, for a Model Cache (``TPLayout``); a rank then copies its
own range, ``TPLayout.shard_range(rank)``, to its device.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from .engine import Engine
from .errors import CheckpointError
from .layout import WeightLayout, weight_layout
from .loader import _FLOAT_CODES, checkpoint_index, tensor_entry
from .spec import ModelSpec
from .st_header import TensorEntry
from .tp_layout import TPLayout, shard_spec, source_slices
from .weights import TORCH_DTYPES

__all__ = ["TPGroup", "bind_shard", "fill_shard", "fill_tp_layout", "join_group",
           "leave_group", "load_shard"]


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: rank ``rank`` of ``size``."""

    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: the default (world) group
    # a gloo group for the few words of a driver's commands (tp_mirror.py); None:
    # the default group (gloo itself on CPUs)
    control: dist.ProcessGroup | None = None

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of ``partial`` over the group's ranks (a new contiguous tensor when
        ``partial`` is a strided view, as the decode projections return)."""
        out = partial.contiguous()
        dist.all_reduce(out, group=self.group)
        return out


def backend_for(device: torch.device) -> str:
    """The collective backend of a device: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(store: Store, rank: int, size: int, device: str | torch.device,
               timeout_s: float = 300.0) -> TPGroup:
    """Join the group rendezvousing through ``store`` (e.g. a ``TCPStore`` one process
    hosts on a free port) as rank ``rank`` of ``size``, on ``device``.

    The group is this process's default group; ``leave_group`` ends it.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo") if backend_for(dev) != "gloo" else None
    return TPGroup(rank, size, dev, control=control)


def leave_group() -> None:
    """End this process's group (every rank calls it; no collective may be in flight)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def bind_shard(engine: Engine, spec: ModelSpec, weights: torch.Tensor,
               kv_region: torch.Tensor, group: TPGroup, dtype: str | None = None) -> None:
    """Bind ``engine`` to this rank's shard of ``spec``: ``weights`` holds the shard's
    layout (``TPLayout.shards[rank]``), ``kv_region`` the rank's KV blocks (of
    ``shard_spec(...).kv_shape``: the rank's kv heads only)."""
    shard = shard_spec(spec, group.rank, group.size)
    reduce = group.all_reduce if group.size > 1 else None
    engine.bind(shard, weights, kv_region, dtype, reduce=reduce)


def fill_shard(model_dir: str | Path, spec: ModelSpec, layout: TPLayout, rank: int,
               dest: torch.Tensor) -> None:
    """Write rank ``rank``'s shard (``layout.shards[rank]``) into host memory ``dest``
    (a contiguous uint8 CPU tensor), reading only that shard's parts of the checkpoint.
    Raises ``CheckpointError`` naming the file and tensor at fault."""
    shard = layout.shards[rank]
    if dest.dtype != torch.uint8 or dest.dim() != 1 or not dest.is_contiguous() \
            or dest.device.type != "cpu" or dest.numel() < shard.total_bytes:
        raise ValueError(f"destination must be a contiguous 1-D uint8 CPU tensor of >= "
                         f"{shard.total_bytes} bytes, got {dest.dtype} {tuple(dest.shape)} "
                         f"on {dest.device}")
    if layout.model != spec.name:
        raise ValueError(f"layout is for model {layout.model!r}, spec is {spec.name!r}")
    full = weight_layout(spec, layout.dtype)
    index = checkpoint_index(model_dir)
    root = Path(model_dir)
    dtype = TORCH_DTYPES[layout.dtype]
    maps: dict[Path, mmap.mmap] = {}
    try:
        end = 0
        for slot in shard.slots:
            dest[end:slot.offset].zero_()
            pos = slot.offset
            shapes = full.slot(slot.name).source_shapes()
            parts = source_slices(spec, slot, rank, layout.size)
            for part, shape in zip(parts, shapes, strict=True):
                entry = tensor_entry(index, root, part.name, shape, floats=True)
                if entry.file not in maps:
                    maps[entry.file] = _map(entry.file)
                data = _read_part(maps[entry.file], entry, part.axis, part.start, part.stop)
                raw = data.to(dtype).contiguous().view(-1).view(torch.uint8)
                dest[pos:pos + raw.numel()].copy_(raw)
                pos += raw.numel()
            end = pos
        dest[end:shard.total_bytes].zero_()
    finally:
        for m in maps.values():
            m.close()


def fill_tp_layout(model_dir: str | Path, spec: ModelSpec, layout: TPLayout,
                   dest: torch.Tensor | bytearray | memoryview,
                   progress: Callable[[int], None] | None = None) -> None:
    """Write every shard of ``layout`` at its offset into host memory ``dest`` (a
    Model Cache's range of ``layout.total_bytes``); gaps between shards are zeroed.
    ``progress`` is told the bytes written so far after each shard."""
    out = dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)
    if out.numel() < layout.total_bytes:
        raise ValueError(f"destination holds {out.numel()} bytes, the {layout.size}-way "
                         f"layout of {layout.model!r} needs {layout.total_bytes}")
    end = 0
    for rank in range(layout.size):
        start, stop = layout.shard_range(rank)
        out[end:start].zero_()
        fill_shard(model_dir, spec, layout, rank, out[start:stop])
        end = stop
        if progress is not None:
            progress(end)
    out[end:layout.total_bytes].zero_()


def load_shard(model_dir: str | Path, spec: ModelSpec, layout: TPLayout, rank: int,
               dest: torch.Tensor) -> WeightLayout:
    """Fill ``dest`` (CPU or an accelerator) with rank ``rank``'s shard straight from
    the checkpoint; returns the shard's layout."""
    shard = layout.shards[rank]
    if dest.device.type == "cpu":
        fill_shard(model_dir, spec, layout, rank, dest)
        return shard
    staging = torch.empty(shard.total_bytes, dtype=torch.uint8, pin_memory=True)
    fill_shard(model_dir, spec, layout, rank, staging)
    dest[:shard.total_bytes].copy_(staging)
    return shard


def _map(path: Path) -> mmap.mmap:
    try:
        with path.open("rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise CheckpointError(path, None, f"cannot read ({exc.strerror})") from None


def _read_part(mapped: mmap.mmap, entry: TensorEntry, axis: int | None, start: int,
               stop: int) -> torch.Tensor:
    """Rows (axis 0) or columns (axis 1) ``[start, stop)`` of ``entry``, or all of it,
    copied out of the map: only the pages holding them are read."""
    src_dtype, itemsize = _FLOAT_CODES[entry.code]
    raw = np.frombuffer(mapped, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
    rows = entry.shape[0] if entry.shape else 1
    table = raw.reshape(rows, -1)
    if axis == 0:
        table = table[start:stop]
    elif axis == 1:
        table = table[:, start * itemsize:stop * itemsize]
    part = np.array(table, copy=True)  # writable, and the shard's bytes only
    return torch.from_numpy(part).view(src_dtype)
