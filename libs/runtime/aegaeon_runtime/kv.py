"""A worker's device KV region and its transfers to and from the unified CPU cache.

The device KV region (the top of the worker's buffer) is a slab-allocated
unified cache: blocks of every model's KV shape share it (paper §5.2). Block
ids handed to the engine are ``offset // block_bytes`` (docs/interfaces.md).

Transfers follow §5.3's rules with events instead of blocking:

1. decoding needs a block's swap-in event complete (callers query it);
2. a swap-in waits for the producer's swap-out event *on the copy stream*
   (``wait_event``), not on the caller;
3. blocks freed while a copy may still touch them go to a move list with
   that copy's event (device side here, host side in the cachemgr), so they
   are never handed out again before it completes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.structs import EventSpec
from aegaeon_engine import KVShape
from aegaeon_gpumem import (
    CopyStream,
    Event,
    EventHandle,
    KVBlockPool,
    OutOfBlocks,
    copy_blocks,
    open_event,
)

from aegaeon_runtime.cacheclient.client import SyncCacheClient, to_event

__all__ = ["KVSpace", "OutOfBlocks", "event_from_spec", "shape_key"]

log = get_logger("kv")


def shape_key(shape: KVShape) -> tuple[int, int, int, int, str]:
    return (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.block_size, shape.dtype)


def event_from_spec(spec: EventSpec | None) -> Event | None:
    """Open another process's transfer event from its message form."""
    if spec is None:
        return None
    fields = {"kind": spec.kind, "table": spec.table, "slot": spec.slot, "value": spec.value,
              "handle": spec.handle, "device": spec.device}  # fmt: skip
    return open_event(EventHandle.from_dict(fields))


class KVSpace:
    """Device KV blocks of one worker and its two copy streams."""

    def __init__(
        self,
        device_region: torch.Tensor,
        host_region: torch.Tensor,
        cache: SyncCacheClient,
        swap_out_stream: CopyStream,
        swap_in_stream: CopyStream,
        slab_bytes: int,
    ) -> None:
        self.device_region = device_region
        self.host_region = host_region
        self.cache = cache
        self.swap_out_stream = swap_out_stream
        self.swap_in_stream = swap_in_stream
        self.pool = KVBlockPool(device_region.numel(), slab_bytes)

    # ---- device blocks ---------------------------------------------------
    def alloc(self, shape: KVShape, num_blocks: int) -> list[int]:
        """Device block ids for ``shape``; OutOfBlocks when the region is full."""
        if num_blocks == 0:
            return []
        bb = shape.block_bytes
        return [o // bb for o in self.pool.alloc(shape_key(shape), bb, num_blocks)]

    def free(self, shape: KVShape, block_ids: Sequence[int], event: Event | None = None) -> None:
        """Free device blocks (after ``event`` when a copy may still read them)."""
        if block_ids:
            bb = shape.block_bytes
            self.pool.free([b * bb for b in block_ids], event)

    def capacity_blocks(self, shape: KVShape) -> int:
        """Blocks of ``shape`` the whole region holds (all slabs given to it)."""
        return self.pool.allocator.capacity_blocks(shape.block_bytes)

    # ---- transfers ---------------------------------------------------------
    def swap_out(self, shape: KVShape, block_ids: Sequence[int]) -> tuple[list[int], Event]:
        """Copy device blocks to newly leased host blocks; free the device blocks
        behind the copy's event. Returns (host offsets, the copy's event)."""
        bb = shape.block_bytes
        host = self.cache.alloc_blocks(shape, len(block_ids)).offsets
        pairs = [(b * bb, h, bb) for b, h in zip(block_ids, host, strict=True)]
        copy_blocks(self.swap_out_stream, self.device_region, self.host_region, pairs)
        event = self.swap_out_stream.record()
        self.free(shape, block_ids, event)
        return host, event

    def swap_in(
        self,
        shape: KVShape,
        host_offsets: Sequence[int],
        block_ids: Sequence[int],
        after: Event | None,
    ) -> Event:
        """Copy host blocks into device blocks ``block_ids`` (same order) once ``after``
        (the producer's swap-out) completes; returns the copy's event."""
        bb = shape.block_bytes
        if after is not None:
            self.swap_in_stream.wait_event(after)
        pairs = [(h, b * bb, bb) for h, b in zip(host_offsets, block_ids, strict=True)]
        copy_blocks(self.swap_in_stream, self.host_region, self.device_region, pairs)
        return self.swap_in_stream.record()

    def free_host(self, host_offsets: Sequence[int], event: Event | None) -> None:
        """Return host blocks to the cachemgr (kept from reuse until ``event``)."""
        if host_offsets:
            spec = None if event is None or event.query() else to_event(event.handle())
            self.cache.free_blocks(list(host_offsets), spec)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the copy streams and the reclaimer, waiting at most ``timeout_s`` for each:
        a copy that waits on an event that never completes (its producer died) must not
        keep the process alive (their threads are daemons)."""
        for stream in (self.swap_out_stream, self.swap_in_stream):
            if not stream.close(timeout_s):
                log.warning("copy_stream_busy_at_close", after_s=timeout_s)
        self.pool.close(timeout_s)
