"""The invariant check of `SlabAllocator` (O(region), for tests and debugging).

Kept apart from the allocator so the hot path stays small; it reads the
allocator's internals on purpose and recomputes every counter from scratch.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from aegaeon_gpumem.errors import IntegrityError

if TYPE_CHECKING:
    from aegaeon_gpumem.slab import SlabAllocator, _Slab


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
