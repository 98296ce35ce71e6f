"""`KVBlockPool`: a thread-safe slab-allocated KV block pool with a move list.

The unified KV cache of a process (the cachemgr's CPU cache, a worker's
device KV region): `alloc` hands out block offsets (multiples of the block
size), `free(offsets, event)` returns them, through the move list when a copy
touching them may still be in flight. A daemon thread reclaims move-list
blocks whose events completed; `alloc` also reclaims once before failing.

Invariant: an offset is in exactly one of {free in the slab allocator, live
and owned by a caller, live and pending in the move list}; only the first
kind is ever returned by `alloc`.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from aegaeon_gpumem.closing import Closing
from aegaeon_gpumem.errors import IntegrityError, InvalidFreeError, OutOfBlocks
from aegaeon_gpumem.events import Event
from aegaeon_gpumem.move_list import MoveList
from aegaeon_gpumem.slab import SlabAllocator, SlabStats

# The daemon only keeps the pool tidy: alloc reclaims synchronously before it
# fails, so a slower poll never causes an OutOfBlocks, and a Python thread
# waking 200 times a second costs little on a shared CPU.
DEFAULT_POLL_INTERVAL_S = 0.005


@dataclass(frozen=True, slots=True)
class KVPoolStats:
    """Slab occupancy (pending blocks count as used) plus the move list's size."""

    slabs: SlabStats
    pending_blocks: int


class KVBlockPool(Closing):
    """SlabAllocator + MoveList behind a lock, with a reclaiming daemon thread.

    Args:
        region_bytes: bytes of the KV region the offsets index.
        slab_bytes: slab size (see `slab.suggest_slab_bytes`).
        poll_interval_s: how often the daemon polls pending events.
        reclaimer: start the daemon thread (tests may drive `reclaim()` alone).
    """

    def __init__(
        self,
        region_bytes: int,
        slab_bytes: int,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        reclaimer: bool = True,
    ) -> None:
        self._slabs = SlabAllocator(region_bytes, slab_bytes)
        self._moves = MoveList()
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._poll_interval_s = poll_interval_s
        self._has_pending = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if reclaimer:
            self._thread = threading.Thread(
                target=self._reclaim_loop, name="aegaeon-movelist", daemon=True
            )
            self._thread.start()

    @property
    def allocator(self) -> SlabAllocator:
        """The slab allocator (read-only use; mutate only through the pool)."""
        return self._slabs

    def alloc(self, shape_key: Hashable, block_bytes: int, n: int) -> list[int]:
        """Allocate `n` blocks (all or nothing); OutOfBlocks if they do not fit even
        after reclaiming completed move-list blocks."""
        with self._lock:
            try:
                return self._slabs.alloc(shape_key, block_bytes, n)
            except OutOfBlocks:
                if not self._reclaim_locked():
                    raise
            return self._slabs.alloc(shape_key, block_bytes, n)

    def free(self, offsets: Iterable[int], event: Event | None = None) -> None:
        """Free blocks; with an incomplete `event` they wait in the move list until it
        completes. All or nothing: InvalidFreeError if an offset is not live, is
        already pending, or repeats."""
        offsets = list(offsets)
        with self._lock:
            if event is None or event.query():
                if self._pending.intersection(offsets):
                    raise InvalidFreeError("freeing blocks that are already in the move list")
                self._slabs.free(offsets)
                return
            bad = [o for o in offsets if o in self._pending or not self._slabs.is_live(o)]
            if bad or len(set(offsets)) != len(offsets):
                raise InvalidFreeError(f"offsets {bad[:8]} are not live, already pending or repeat")
            self._moves.add(event, offsets)
            self._pending.update(offsets)
            self._has_pending.set()

    def reclaim(self) -> int:
        """Return move-list blocks whose events completed to the allocator; return how many."""
        with self._lock:
            return self._reclaim_locked()

    def _reclaim_locked(self) -> int:
        done = self._moves.poll()
        if done:
            self._pending.difference_update(done)
            self._slabs.free(done)
        if not self._moves.pending_blocks:
            self._has_pending.clear()
        return len(done)

    def _reclaim_loop(self) -> None:
        while True:
            self._has_pending.wait()
            if self._stop.wait(self._poll_interval_s):
                return
            self.reclaim()

    def stats(self) -> KVPoolStats:
        """Slab stats and the number of blocks waiting in the move list."""
        with self._lock:
            return KVPoolStats(self._slabs.stats(), self._moves.pending_blocks)

    def check_integrity(self) -> None:
        """Slab invariants, and every pending block is live and held exactly once."""
        with self._lock:
            self._slabs.check_integrity()
            held = self._moves.pending_offsets()
            if sorted(held) != sorted(self._pending) or len(held) != len(set(held)):
                raise IntegrityError("move list and pending set disagree")
            if any(not self._slabs.is_live(o) for o in held):
                raise IntegrityError("a move-list block is not live in the allocator")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the reclaimer thread (pending blocks stay pending; idempotent); wait at
        most ``timeout_s`` for it (it is a daemon)."""
        self._stop.set()
        self._has_pending.set()  # wake it if it sleeps on "nothing pending"
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
