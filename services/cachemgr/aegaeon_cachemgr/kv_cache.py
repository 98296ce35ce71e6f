"""The unified CPU KV cache: one shared region, slab-allocated blocks leased to owners.

Blocks of every KV shape share the region through the gpumem ``KVBlockPool``
(slabs per shape, a move list for blocks whose copies may be in flight, a
daemon thread reclaiming them). On top of it this module keeps the lease of
every live block: ``offset -> owner``, so the blocks of a worker that dies are
reclaimed, and frees/reassignments are checked against the caller.

Invariant: an offset is leased iff it is live in the pool and not pending in
its move list; ``sum(blocks_per_owner) == live - pending``.

A free's event is opened in its CPU form (``open_host_event``: a CUDA event's
host mirror, which its worker's copy stream signals): the cachemgr needs no GPU
and holds no CUDA context (compose runs it with ``CUDA_VISIBLE_DEVICES=""``).
"""

from __future__ import annotations

from collections import defaultdict

from aegaeon_common.messages.cache import KVCacheStats, ShapeCount
from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_engine.spec import DTYPE_BYTES, KVShape
from aegaeon_gpumem import (
    BadEventHandleError,
    BlockTooLargeError,
    Event,
    InvalidFreeError,
    KVBlockPool,
    OutOfBlocks,
    ShmRegion,
    SlabStats,
    open_host_event,
)

from aegaeon_cachemgr.errors import CacheError

ShapeKey = tuple[int, int, int, int, str]


def shape_key(shape: KVShapeSpec) -> ShapeKey:
    """The pool's key for a shape (and the block size it implies); bad_request if invalid."""
    dims = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.block_size)
    if min(dims) <= 0 or shape.dtype not in DTYPE_BYTES:
        raise CacheError(
            "bad_request",
            f"invalid KV shape {shape}: dimensions must be positive "
            f"and dtype one of {sorted(DTYPE_BYTES)}",
        )
    return (*dims, shape.dtype)


def _spec(key: object) -> KVShapeSpec:
    assert isinstance(key, tuple)  # the pool only ever sees our ShapeKeys
    return KVShapeSpec(*key)


class UnifiedKVCache:
    """Leased KV blocks over ``region`` (the region's owner is the caller)."""

    def __init__(self, region: ShmRegion, slab_bytes: int, event_table: str) -> None:
        self.region = region
        self.slab_bytes = slab_bytes
        self._event_table = event_table
        self._pool = KVBlockPool(region.nbytes, slab_bytes)
        self._owner_of: dict[int, str] = {}
        self._blocks_of: defaultdict[str, set[int]] = defaultdict(set)
        # blocks freed at once, and behind a copy's event still in flight (move list)
        self.freed_blocks = 0
        self.deferred_blocks = 0

    def alloc(self, owner: str, shape: KVShapeSpec, num_blocks: int) -> tuple[list[int], int]:
        """``num_blocks`` blocks of ``shape`` for ``owner``: (offsets, block_bytes)."""
        key = shape_key(shape)
        block_bytes = KVShape(*key).block_bytes  # the engine owns the block layout
        if num_blocks <= 0:
            raise CacheError("bad_request", f"num_blocks must be positive, got {num_blocks}")
        try:
            offsets = self._pool.alloc(key, block_bytes, num_blocks)
        except OutOfBlocks as exc:
            raise CacheError(
                "out_of_blocks",
                f"{exc} (KV cache {self.region.nbytes} bytes, slabs of {self.slab_bytes})",
                {
                    "requested_blocks": num_blocks,
                    "block_bytes": block_bytes,
                    "requested_bytes": num_blocks * block_bytes,
                    "available_blocks": exc.available_blocks,
                    "capacity_blocks": exc.capacity_blocks,
                    "capacity_bytes": self.region.nbytes,
                },
            ) from None
        except BlockTooLargeError as exc:
            raise CacheError(
                "bad_request",
                f"{exc} (cachemgr.slab_bytes)",
                {"block_bytes": block_bytes, "slab_bytes": self.slab_bytes},
            ) from None
        self._owner_of.update(dict.fromkeys(offsets, owner))
        self._blocks_of[owner].update(offsets)
        return offsets, block_bytes

    def _check_leased(self, offsets: list[int], owner: str | None) -> None:
        if len(set(offsets)) != len(offsets):
            raise CacheError("bad_request", "the same offset appears twice")
        unknown = [o for o in offsets if o not in self._owner_of]
        if unknown:
            raise CacheError(
                "bad_request",
                f"offsets {unknown[:8]} are not leased blocks "
                "(never allocated, already freed, or reclaimed)",
            )
        if owner is not None:
            foreign = [o for o in offsets if self._owner_of[o] != owner]
            if foreign:
                raise CacheError(
                    "not_owner",
                    f"offsets {foreign[:8]} are leased to "
                    f"{self._owner_of[foreign[0]]!r}, not {owner!r}",
                )

    def _open(self, ref: EventSpec) -> Event:
        """The event's CPU form (a CUDA event's host mirror): no CUDA call here."""
        if ref.value > 0 and ref.table and ref.table != self._event_table:
            raise CacheError(
                "bad_request",
                f"event table {ref.table!r} is not this cachemgr's ({self._event_table!r})",
            )
        fields: dict[str, object] = {"kind": ref.kind, "table": ref.table, "slot": ref.slot,
                                     "value": ref.value}  # fmt: skip
        if ref.kind == "cuda":
            fields.update(handle=ref.handle, device=ref.device)
        try:
            return open_host_event(fields)
        except (BadEventHandleError, ValueError, RuntimeError) as exc:
            raise CacheError("bad_request", f"bad event handle: {exc}") from None

    def free(self, owner: str, offsets: list[int], event: EventSpec | None) -> tuple[int, int]:
        """End the lease of ``offsets``; with an incomplete event they go to the move
        list. Returns (freed now, deferred)."""
        self._check_leased(offsets, owner)
        opened = self._open(event) if event is not None else None
        deferred = opened is not None and not opened.query()
        try:
            self._pool.free(offsets, opened)
        except InvalidFreeError as exc:
            raise CacheError("bad_request", str(exc)) from None
        self._drop_leases(offsets)
        if deferred:
            self.deferred_blocks += len(offsets)
            return 0, len(offsets)
        self.freed_blocks += len(offsets)
        return len(offsets), 0

    def _drop_leases(self, offsets: list[int]) -> None:
        for off in offsets:
            owner = self._owner_of.pop(off)
            blocks = self._blocks_of[owner]
            blocks.discard(off)
            if not blocks:
                del self._blocks_of[owner]

    def reassign(self, offsets: list[int], new_owner: str, owner: str | None) -> int:
        """Move the lease of ``offsets`` to ``new_owner``."""
        self._check_leased(offsets, owner)
        self._drop_leases(offsets)
        self._owner_of.update(dict.fromkeys(offsets, new_owner))
        self._blocks_of[new_owner].update(offsets)
        return len(offsets)

    def release_owner(self, owner: str) -> int:
        """Free every block leased to ``owner`` now (its process ended: no copy of its
        own is in flight any more). Returns how many."""
        offsets = sorted(self._blocks_of.get(owner, ()))
        if offsets:
            self._pool.free(offsets)
            self._drop_leases(offsets)
        return len(offsets)

    def num_blocks(self, owner: str) -> int:
        return len(self._blocks_of.get(owner, ()))

    def slab_stats(self) -> SlabStats:
        """The slab allocator's counts (per shape: used and free blocks)."""
        return self._pool.stats().slabs

    def stats(self) -> KVCacheStats:
        pool = self._pool.stats()
        slabs = pool.slabs
        shapes = [
            ShapeCount(_spec(key), s.block_bytes, s.used_blocks, s.held_slabs, s.fragmentation)
            for key, s in slabs.shapes.items()
        ]
        return KVCacheStats(
            capacity_bytes=self.region.nbytes,
            slab_bytes=self.slab_bytes,
            used_bytes=slabs.used_bytes,
            held_bytes=slabs.held_bytes,
            peak_used_bytes=slabs.peak_used_bytes,
            peak_held_bytes=slabs.peak_held_bytes,
            fragmentation=slabs.fragmentation,
            blocks_per_owner={o: len(b) for o, b in sorted(self._blocks_of.items())},
            move_list_blocks=pool.pending_blocks,
            shapes=shapes,
            freed_blocks=self.freed_blocks,
            deferred_blocks=self.deferred_blocks,
        )

    def close(self) -> None:
        """Stop the reclaimer thread (the region is closed by its owner)."""
        self._pool.close()
