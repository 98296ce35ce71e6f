"""Slab allocator for KV blocks of many shapes over one region: pure bookkeeping.

The region [0, region_bytes) is split into `num_slabs = region_bytes // slab_bytes`
fixed-size slabs (a tail shorter than a slab is never used). A slab is either
in the free pool or held by one shape (any hashable key, e.g. (layers, kv
heads, head dim, block size, dtype)) and then serves only blocks of that
shape's `block_bytes`. A slab goes back to the pool the moment its last block
is freed.

Placement invariant (the engine addresses blocks as `offset // block_bytes`
relative to the region start): every block offset is a multiple of its
`block_bytes`. In slab i (bytes [i*S, (i+1)*S)) the first block starts at the
first multiple of B at or after i*S, and blocks never cross (i+1)*S, so slab i
holds `floor(((i+1)*S - ceil(i*S / B)*B) / B)` blocks; when S is a multiple of
B that is S / B in every slab. The tail and alignment waste per slab is < B;
larger slabs raise the slack held in partially filled slabs. About 8 of the
largest blocks per slab keeps fragmentation near 10% on mixed-shape churn
(`suggest_slab_bytes`, the test `test_gpumem_slab.py`).

Cost: alloc and free of n blocks are O(n) with small constants; only
`check_integrity` and the error path of `alloc` scan all slabs.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from aegaeon_gpumem.errors import (
    BlockTooLargeError,
    IntegrityError,
    InvalidFreeError,
    OutOfBlocks,
)

# ---- statistics: what a slab allocator holds, by shape ----------------------------


def suggest_slab_bytes(max_block_bytes: int, blocks_per_slab: int = 8, align: int = 1 << 20) -> int:
    """A slab size holding `blocks_per_slab` of the largest block, rounded up to `align`.

    Larger slabs hold more slack (a shape's partially filled slabs); smaller
    ones waste up to a block per slab in tail/alignment and turn over more
    often (cheap). The fragmentation measured at 8, 16 and 32 blocks per slab
    is in docs/results.md ("Numbers behind defaults").
    """
    raw = max_block_bytes * blocks_per_slab
    return -(-raw // align) * align


def ratio(numerator: int, denominator: int) -> float:
    """numerator / denominator, 0.0 when the denominator is 0."""
    return numerator / denominator if denominator else 0.0


@dataclass(frozen=True, slots=True)
class ShapeStats:
    """Occupancy of one shape's slabs (bytes unless named otherwise).

    `fragmentation` = (held_bytes - used_bytes) / peak_held_bytes of this
    shape (the per-shape curves of the paper's Fig. 16), 0.0 if never held.
    """

    block_bytes: int
    used_blocks: int
    free_blocks: int
    held_slabs: int
    used_bytes: int
    held_bytes: int
    peak_held_bytes: int
    fragmentation: float


@dataclass(frozen=True, slots=True)
class SlabStats:
    """Occupancy of a slab region (bytes unless named otherwise).

    `fragmentation` follows the paper's Fig. 16, "the ratio of unused memory to
    peak allocated memory": (held_bytes - used_bytes) / peak_held_bytes, where
    held bytes are the bytes of slabs currently assigned to a shape (memory
    the allocator has taken out of the pool), used bytes are the bytes of live
    blocks, and peak_held_bytes is the most ever held at once. Unused memory
    thus counts the free blocks of partially filled slabs and the per-slab
    tail/alignment waste; slabs back in the pool are not "allocated" and do
    not count. 0.0 before anything was ever allocated.
    """

    region_bytes: int
    slab_bytes: int
    num_slabs: int
    free_slabs: int
    held_slabs: int
    held_bytes: int
    used_bytes: int
    peak_held_bytes: int
    peak_used_bytes: int
    fragmentation: float
    shapes: dict[Hashable, ShapeStats]


class _Slab:
    """A held slab. Blocks [0, bump) were handed out at least once; of those,
    the ones not live are in `free` (offsets, a stack). Blocks [bump, capacity)
    were never used and are taken as a contiguous range."""

    __slots__ = ("block_bytes", "bump", "capacity", "first", "free", "index", "shape", "used")

    def __init__(self, index: int, shape: _Shape, first: int, capacity: int) -> None:
        self.index = index
        self.shape = shape
        self.block_bytes = shape.block_bytes
        self.first = first
        self.capacity = capacity
        self.bump = 0
        self.free: list[int] = []
        self.used = 0


class _Shape:
    __slots__ = (
        "block_bytes",
        "free_blocks",
        "held_slabs",
        "key",
        "partial",
        "peak_held_bytes",
        "used_blocks",
    )

    def __init__(self, key: Hashable, block_bytes: int) -> None:
        self.key = key
        self.block_bytes = block_bytes
        # Held slabs with at least one free block, by slab index, in the
        # order in which they gained free space (alloc takes the newest).
        self.partial: dict[int, _Slab] = {}
        self.held_slabs = 0
        self.used_blocks = 0
        self.free_blocks = 0  # free blocks in held slabs
        self.peak_held_bytes = 0


class SlabAllocator:
    """KV blocks of any shape in fixed-size slabs of one region (offsets only, no memory).
    Not thread-safe: `KVBlockPool` puts it behind a lock.

    Args:
        region_bytes: bytes of the region the offsets index.
        slab_bytes: bytes per slab (see module docstring for the choice).
    """

    def __init__(self, region_bytes: int, slab_bytes: int) -> None:
        if slab_bytes <= 0 or region_bytes < 0:
            raise ValueError(
                f"need slab_bytes > 0 and region_bytes >= 0, got {slab_bytes}, {region_bytes}"
            )
        self._region_bytes = region_bytes
        self._slab_bytes = slab_bytes
        self._num_slabs = region_bytes // slab_bytes
        # Free pool as a stack; reversed so that slab 0 is handed out first.
        self._pool: list[int] = list(range(self._num_slabs - 1, -1, -1))
        self._slabs: list[_Slab | None] = [None] * self._num_slabs
        self._shapes: dict[Hashable, _Shape] = {}
        # Every live block offset -> its slab: O(1) validation and lookup in free().
        self._live: dict[int, _Slab] = {}
        self._used_bytes = 0
        self._peak_used_bytes = 0
        self._peak_held_bytes = 0
        self._capacity: dict[int, int] = {}  # block_bytes -> capacity_blocks (fixed sizes)

    @property
    def region_bytes(self) -> int:
        """Bytes of the region."""
        return self._region_bytes

    @property
    def slab_bytes(self) -> int:
        """Bytes per slab."""
        return self._slab_bytes

    @property
    def num_slabs(self) -> int:
        """Number of slabs in the region."""
        return self._num_slabs

    def _first_block(self, slab_index: int, block_bytes: int) -> int:
        # The first multiple of block_bytes at or after the slab's start.
        return -(-slab_index * self._slab_bytes // block_bytes) * block_bytes

    def slab_capacity(self, slab_index: int, block_bytes: int) -> int:
        """Blocks of `block_bytes` that slab `slab_index` holds under the placement invariant."""
        end = (slab_index + 1) * self._slab_bytes
        return max(0, (end - self._first_block(slab_index, block_bytes)) // block_bytes)

    def capacity_blocks(self, block_bytes: int) -> int:
        """Blocks of `block_bytes` the whole region holds if every slab served them."""
        capacity = self._capacity.get(block_bytes)
        if capacity is None:  # a decode step asks per sequence: computed once per size
            capacity = sum(self.slab_capacity(i, block_bytes) for i in range(self._num_slabs))
            self._capacity[block_bytes] = capacity
        return capacity

    def _shape(self, shape_key: Hashable, block_bytes: int) -> _Shape:
        shape = self._shapes.get(shape_key)
        if shape is None:
            if block_bytes <= 0:
                raise ValueError(f"block_bytes must be positive, got {block_bytes}")
            if block_bytes > self._slab_bytes:
                raise BlockTooLargeError(block_bytes, self._slab_bytes)
            shape = self._shapes[shape_key] = _Shape(shape_key, block_bytes)
        elif shape.block_bytes != block_bytes:
            raise ValueError(
                f"shape {shape_key!r} has block_bytes {shape.block_bytes}, not {block_bytes}"
            )
        return shape

    def free_blocks(self, shape_key: Hashable) -> int:
        """Free blocks in the slabs `shape_key` holds now (not counting pool slabs)."""
        return shape.free_blocks if (shape := self._shapes.get(shape_key)) else 0

    def alloc(self, shape_key: Hashable, block_bytes: int, n: int) -> list[int]:
        """Allocate `n` blocks of `block_bytes` for `shape_key`; return their byte offsets.

        All or nothing: on OutOfBlocks nothing changed. Free blocks of the
        shape's held slabs are used first, then slabs from the pool.
        """
        if n < 0:
            raise ValueError(f"block count must be >= 0, got {n}")
        shape = self._shape(shape_key, block_bytes)
        if n == 0:
            return []
        free_held = shape.free_blocks
        need = n - free_held
        if need > 0:
            self._acquire(shape, need, n, free_held)
        out: list[int] = []
        remaining = n
        partial = shape.partial
        live = self._live
        while remaining:
            # Newest partial slab first (LIFO): its hole is usually one departed
            # request, so a request's blocks stay together and leave together,
            # letting slabs drain. On mixed-shape churn this measured better
            # than oldest-first and fullest-first (which scatters requests).
            slab = next(reversed(partial.values()))
            take = min(remaining, slab.capacity - slab.used)
            from_free = min(take, len(slab.free))
            cut = len(slab.free) - from_free  # not [-from_free:]: -0 would take all
            taken = slab.free[cut:]
            del slab.free[cut:]
            fresh = take - from_free
            if fresh:
                start = slab.first + slab.bump * block_bytes
                taken.extend(range(start, start + fresh * block_bytes, block_bytes))
                slab.bump += fresh
            slab.used += take
            if slab.used == slab.capacity:
                del partial[slab.index]
            live.update(dict.fromkeys(taken, slab))
            out.extend(taken)
            remaining -= take
        shape.used_blocks += n
        shape.free_blocks -= n
        self._used_bytes += n * block_bytes
        self._peak_used_bytes = max(self._peak_used_bytes, self._used_bytes)
        return out

    def _acquire(self, shape: _Shape, need: int, n: int, free_held: int) -> None:
        """Move slabs from the pool to `shape` until `need` more blocks fit, or raise."""
        pool = self._pool
        taken: list[tuple[int, int]] = []
        skipped: list[int] = []
        got = 0
        while got < need and pool:
            index = pool.pop()
            capacity = self.slab_capacity(index, shape.block_bytes)
            if capacity == 0:
                skipped.append(index)  # alignment leaves no room for this block size
                continue
            taken.append((index, capacity))
            got += capacity
        pool.extend(reversed(skipped))
        if got < need:
            pool.extend(index for index, _ in reversed(taken))
            b = shape.block_bytes
            capacity_blocks = self.capacity_blocks(b)
            raise OutOfBlocks(
                shape.key,
                b,
                requested_blocks=n,
                available_blocks=free_held + got,
                capacity_blocks=capacity_blocks,
                capacity_bytes=capacity_blocks * b,
            )
        # Reversed so the LIFO pick in alloc uses them in acquisition order.
        for index, capacity in reversed(taken):
            slab = _Slab(index, shape, self._first_block(index, shape.block_bytes), capacity)
            self._slabs[index] = slab
            shape.partial[index] = slab
        shape.held_slabs += len(taken)
        shape.free_blocks += got
        held = self._slab_bytes * shape.held_slabs
        shape.peak_held_bytes = max(shape.peak_held_bytes, held)
        self._peak_held_bytes = max(
            self._peak_held_bytes, self._slab_bytes * (self._num_slabs - len(pool))
        )

    def free(self, offsets: Iterable[int]) -> None:
        """Free blocks by offset. All or nothing: InvalidFree (nothing changed) if
        an offset is not a live block or appears twice."""
        offsets = list(offsets)
        live = self._live
        bad = [off for off in offsets if off not in live]
        if bad:
            raise InvalidFreeError(
                f"offsets {bad[:8]} are not live blocks (double free or never allocated)"
            )
        if len(set(offsets)) != len(offsets):
            raise InvalidFreeError("the same offset appears twice in one free")
        touched: dict[_Slab, int] = {}
        for off in offsets:
            slab = live.pop(off)
            slab.free.append(off)
            touched[slab] = touched.get(slab, 0) + 1
        for slab, count in touched.items():
            shape = slab.shape
            shape.used_blocks -= count
            shape.free_blocks += count
            self._used_bytes -= count * slab.block_bytes
            was_full = slab.used == slab.capacity
            slab.used -= count
            if slab.used == 0:
                # Empty slabs go back to the pool at once.
                shape.partial.pop(slab.index, None)
                shape.held_slabs -= 1
                shape.free_blocks -= slab.capacity
                self._slabs[slab.index] = None
                self._pool.append(slab.index)
            elif was_full:
                shape.partial[slab.index] = slab

    def is_live(self, offset: int) -> bool:
        """True if `offset` is a live (allocated, not freed) block."""
        return offset in self._live

    def stats(self) -> SlabStats:
        """Occupancy and fragmentation (definition in `SlabStats`)."""
        slab_bytes = self._slab_bytes
        shapes: dict[Hashable, ShapeStats] = {}
        for key, shape in self._shapes.items():
            used_bytes = shape.used_blocks * shape.block_bytes
            held_bytes = shape.held_slabs * slab_bytes
            shapes[key] = ShapeStats(
                block_bytes=shape.block_bytes,
                used_blocks=shape.used_blocks,
                free_blocks=shape.free_blocks,
                held_slabs=shape.held_slabs,
                used_bytes=used_bytes,
                held_bytes=held_bytes,
                peak_held_bytes=shape.peak_held_bytes,
                fragmentation=ratio(held_bytes - used_bytes, shape.peak_held_bytes),
            )
        num_slabs = self._region_bytes // slab_bytes
        held_slabs = num_slabs - len(self._pool)
        held_bytes = held_slabs * slab_bytes
        return SlabStats(
            region_bytes=self._region_bytes,
            slab_bytes=slab_bytes,
            num_slabs=num_slabs,
            free_slabs=len(self._pool),
            held_slabs=held_slabs,
            held_bytes=held_bytes,
            used_bytes=self._used_bytes,
            peak_held_bytes=self._peak_held_bytes,
            peak_used_bytes=self._peak_used_bytes,
            fragmentation=ratio(held_bytes - self._used_bytes, self._peak_held_bytes),
            shapes=shapes,
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError if any invariant is broken (O(region); for tests)."""
        check_slab_allocator(self)


# ---- the invariant check (O(region), for tests and debugging): it reads the
# allocator's internals on purpose and recomputes every counter from scratch ----

def _fail(message: str) -> None:
    raise IntegrityError(message)


def _check_slab(alloc: SlabAllocator, slab: _Slab, live_offsets: list[int]) -> None:
    b = slab.block_bytes
    start = slab.index * alloc.slab_bytes
    end = start + alloc.slab_bytes
    if slab.first % b or not start <= slab.first < start + b:
        _fail(f"slab {slab.index}: first block {slab.first} is not the first multiple of {b}")
    if slab.capacity != alloc.slab_capacity(slab.index, b) or slab.capacity <= 0:
        _fail(f"slab {slab.index}: capacity {slab.capacity} is wrong for blocks of {b}")
    if not 0 <= slab.bump <= slab.capacity:
        _fail(f"slab {slab.index}: bump {slab.bump} outside [0, {slab.capacity}]")
    if slab.used != len(live_offsets) or slab.used == 0:
        _fail(f"slab {slab.index}: used {slab.used} but {len(live_offsets)} live blocks")
    handed = live_offsets + slab.free
    if len(set(handed)) != len(handed):
        _fail(f"slab {slab.index}: a block is both live and free, or free twice")
    if len(handed) != slab.bump:
        _fail(f"slab {slab.index}: {len(handed)} live+free blocks but bump is {slab.bump}")
    limit = slab.first + slab.bump * b
    for off in handed:
        if off % b or not slab.first <= off < limit or off + b > end:
            _fail(f"slab {slab.index}: block {off} misaligned or outside the handed-out range")
    in_partial = slab.shape.partial.get(slab.index) is slab
    if in_partial != (slab.used < slab.capacity):
        _fail(f"slab {slab.index}: partial-list membership {in_partial} but used {slab.used}")


def check_slab_allocator(alloc: SlabAllocator) -> None:
    """Raise IntegrityError if an invariant of `alloc` is broken."""
    pool = alloc._pool
    if len(set(pool)) != len(pool) or any(not 0 <= i < alloc.num_slabs for i in pool):
        _fail("free pool has duplicates or out-of-range slabs")
    for i in pool:
        if alloc._slabs[i] is not None:
            _fail(f"slab {i} is in the pool and held")
    held = [s for s in alloc._slabs if s is not None]
    if len(held) + len(pool) != alloc.num_slabs:
        _fail(f"{len(held)} held + {len(pool)} free slabs != {alloc.num_slabs}")
    by_slab: dict[int, list[int]] = {s.index: [] for s in held}
    for off, slab in alloc._live.items():
        if alloc._slabs[slab.index] is not slab:
            _fail(f"live block {off} belongs to slab {slab.index}, which is not held")
        by_slab[slab.index].append(off)
    for slab in held:
        if alloc._shapes.get(slab.shape.key) is not slab.shape:
            _fail(f"slab {slab.index} holds an unknown shape {slab.shape.key!r}")
        _check_slab(alloc, slab, by_slab[slab.index])
    used_bytes = 0
    for shape in alloc._shapes.values():
        mine = [s for s in held if s.shape is shape]
        used = sum(s.used for s in mine)
        free = sum(s.capacity - s.used for s in mine)
        if (shape.held_slabs, shape.used_blocks, shape.free_blocks) != (len(mine), used, free):
            _fail(
                f"shape {shape.key!r}: counters (slabs, used, free) = "
                f"{(shape.held_slabs, shape.used_blocks, shape.free_blocks)}, "
                f"recomputed {(len(mine), used, free)}"
            )
        if any(alloc._slabs[i] is not s for i, s in shape.partial.items()):
            _fail(f"shape {shape.key!r}: partial list names a slab it does not hold")
        used_bytes += used * shape.block_bytes
    if used_bytes != alloc._used_bytes:
        _fail(f"used bytes {alloc._used_bytes}, recomputed {used_bytes}")
    # No two live blocks overlap (also across slabs and shapes).
    spans = sorted((off, slab.block_bytes) for off, slab in alloc._live.items())
    for (a, a_len), (b, _) in itertools.pairwise(spans):
        if a + a_len > b:
            _fail(f"blocks at {a} (+{a_len}) and {b} overlap")
    if spans and spans[-1][0] + spans[-1][1] > alloc.num_slabs * alloc.slab_bytes:
        _fail("a block lies past the last slab")
