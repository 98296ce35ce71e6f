"""Fragmentation of the unified CPU KV cache under a mixed-model workload (paper Fig. 16).

Requests of every market model (each with its own KV shape) arrive and leave
at random through the cachemgr's ``AllocBlocks``/``FreeBlocks``: an arrival
leases the blocks of a random context length, a departure frees a random
live request's blocks. Arrivals are favoured while the cache is below the
target occupancy and departures above it. Fragmentation is the cachemgr's
own figure, (held - used) / peak held (``KVCacheStats.fragmentation``),
sampled once the cache first reached the target occupancy; the run ends with
everything freed.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from aegaeon_common.transport import RemoteError
from aegaeon_engine import KVShape
from aegaeon_runtime.cacheclient.client import SyncCacheClient

MIN_TOKENS = 16
MAX_TOKENS = 1024


@dataclass(frozen=True)
class FragmentationResult:
    """Fragmentation samples' summary and the workload's size."""

    mean: float
    max: float
    last: float
    num_ops: int
    num_refused: int
    peak_used_fraction: float
    per_shape_last: dict[str, float]


def run_kv_workload(cache: SyncCacheClient, shapes: dict[str, KVShape], num_ops: int, seed: int,
                    target_fraction: float = 0.7, sample_every: int = 20
                    ) -> FragmentationResult:  # fmt: skip
    """Run the workload (see module docstring) on an otherwise idle KV cache."""
    rng = random.Random(seed)
    names: Sequence[str] = sorted(shapes)
    capacity = cache.stats().kv.capacity_bytes
    live: list[tuple[list[int], int]] = []  # (offsets, bytes)
    used = 0
    refused = 0
    samples: list[float] = []
    warm = False
    try:
        for op in range(num_ops):
            arrive = not live or (used < target_fraction * capacity and rng.random() < 0.6) or (
                used >= target_fraction * capacity and rng.random() < 0.2)
            if arrive:
                shape = shapes[rng.choice(names)]
                blocks = shape.blocks_for(rng.randint(MIN_TOKENS, MAX_TOKENS))
                try:
                    offsets = cache.alloc_blocks(shape, blocks).offsets
                except RemoteError as exc:
                    if exc.code != "out_of_blocks":
                        raise
                    refused += 1
                else:
                    live.append((offsets, blocks * shape.block_bytes))
                    used += blocks * shape.block_bytes
            else:
                offsets, nbytes = live.pop(rng.randrange(len(live)))
                cache.free_blocks(offsets)
                used -= nbytes
            warm = warm or used >= target_fraction * capacity
            if warm and op % sample_every == 0:
                samples.append(cache.stats().kv.fragmentation)
        stats = cache.stats().kv
    finally:
        for offsets, _ in live:
            cache.free_blocks(offsets)
    per_shape = {
        f"{s.shape.num_layers}x{s.shape.num_kv_heads}x{s.shape.head_dim}": round(s.fragmentation, 4)
        for s in stats.shapes
    }
    return FragmentationResult(
        mean=statistics.fmean(samples) if samples else stats.fragmentation,
        max=max(samples, default=stats.fragmentation), last=stats.fragmentation,
        num_ops=num_ops, num_refused=refused,
        peak_used_fraction=stats.peak_used_bytes / capacity, per_shape_last=per_shape,
    )  # fmt: skip
