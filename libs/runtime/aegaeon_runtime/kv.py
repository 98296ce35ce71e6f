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

A tensor-parallel instance (``aegaeon_runtime.tp``): rank 0's KVSpace also maps
every follower's KV region (``peers``) and moves a sharded model's KV for the
whole group. Its blocks (a ``GroupKVShape`` of ``parts`` parts) are one device
block of ``part_bytes`` at the same block id on every rank, and one host block
holding the parts back to back; a swap copies each rank's part on rank 0's
copy streams, so one event covers the group's copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
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


def shape_key(shape: KVShape) -> tuple[int | str, ...]:
    """The device pool's key of ``shape``: its numbers, and its parts when a block spans
    the ranks of a tensor-parallel group (its device blocks are smaller)."""
    key: tuple[int | str, ...] = (shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                  shape.block_size, shape.dtype)  # fmt: skip
    parts = parts_of(shape)
    return key if parts == 1 else (*key, parts)


def parts_of(shape: KVShape) -> int:
    """Ranks a block of ``shape`` spans (a ``GroupKVShape``'s parts; 1 otherwise)."""
    return int(getattr(shape, "parts", 1))


def device_block_bytes(shape: KVShape) -> int:
    """One device block of ``shape`` on one rank."""
    return shape.block_bytes // parts_of(shape)


def event_from_spec(spec: EventSpec | None) -> Event | None:
    """Open another process's transfer event from its message form."""
    if spec is None:
        return None
    return open_event(EventHandle.from_dict(msgspec.structs.asdict(spec)))


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
        peers: Sequence[torch.Tensor] = (),
    ) -> None:
        self.device_region = device_region
        # the followers' KV regions (ranks 1..), each at least this one's size
        self.peers = list(peers)
        if any(p.numel() < device_region.numel() for p in self.peers):
            raise ValueError("a follower's KV region is smaller than rank 0's")
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
        bb = device_block_bytes(shape)
        return [o // bb for o in self.pool.alloc(shape_key(shape), bb, num_blocks)]

    def free(self, shape: KVShape, block_ids: Sequence[int], event: Event | None = None) -> None:
        """Free device blocks (after ``event`` when a copy may still read them)."""
        if block_ids:
            bb = device_block_bytes(shape)
            self.pool.free([b * bb for b in block_ids], event)

    def capacity_blocks(self, shape: KVShape) -> int:
        """Blocks of ``shape`` the whole region holds (all slabs given to it)."""
        return self.pool.allocator.capacity_blocks(device_block_bytes(shape))

    def _regions(self, shape: KVShape) -> list[torch.Tensor]:
        """The device regions holding a block's parts, rank by rank."""
        parts = parts_of(shape)
        if parts > 1 + len(self.peers):
            raise ValueError(f"a block of {parts} parts, but this instance has "
                             f"{1 + len(self.peers)} ranks")  # fmt: skip
        return [self.device_region, *self.peers[:parts - 1]]

    # ---- transfers ---------------------------------------------------------
    def swap_out(self, shape: KVShape, block_ids: Sequence[int]) -> tuple[list[int], Event]:
        """Copy device blocks to newly leased host blocks; free the device blocks
        behind the copy's event. Returns (host offsets, the copy's event)."""
        bb = device_block_bytes(shape)
        host = self.cache.alloc_blocks(shape, len(block_ids)).offsets
        for rank, region in enumerate(self._regions(shape)):
            pairs = [(b * bb, h + rank * bb, bb) for b, h in zip(block_ids, host, strict=True)]
            copy_blocks(self.swap_out_stream, region, self.host_region, pairs)
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
        bb = device_block_bytes(shape)
        if after is not None:
            self.swap_in_stream.wait_event(after)
        for rank, region in enumerate(self._regions(shape)):
            pairs = [(h + rank * bb, b * bb, bb)
                     for h, b in zip(host_offsets, block_ids, strict=True)]  # fmt: skip
            copy_blocks(self.swap_in_stream, self.host_region, region, pairs)
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
