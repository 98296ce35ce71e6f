"""Sizing, occupancy and fragmentation figures of a `SlabAllocator` (plain data)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


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

    @classmethod
    def from_counts(
        cls,
        *,
        block_bytes: int,
        slab_bytes: int,
        used_blocks: int,
        free_blocks: int,
        held_slabs: int,
        peak_held_bytes: int,
    ) -> ShapeStats:
        """Derive the byte figures and fragmentation from the allocator's counters."""
        used_bytes = used_blocks * block_bytes
        held_bytes = held_slabs * slab_bytes
        return cls(
            block_bytes=block_bytes,
            used_blocks=used_blocks,
            free_blocks=free_blocks,
            held_slabs=held_slabs,
            used_bytes=used_bytes,
            held_bytes=held_bytes,
            peak_held_bytes=peak_held_bytes,
            fragmentation=ratio(held_bytes - used_bytes, peak_held_bytes),
        )


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

    @classmethod
    def from_counts(
        cls,
        *,
        region_bytes: int,
        slab_bytes: int,
        free_slabs: int,
        used_bytes: int,
        peak_held_bytes: int,
        peak_used_bytes: int,
        shapes: dict[Hashable, ShapeStats],
    ) -> SlabStats:
        """Derive slab counts, held bytes and fragmentation from the allocator's counters."""
        num_slabs = region_bytes // slab_bytes
        held_slabs = num_slabs - free_slabs
        held_bytes = held_slabs * slab_bytes
        return cls(
            region_bytes=region_bytes,
            slab_bytes=slab_bytes,
            num_slabs=num_slabs,
            free_slabs=free_slabs,
            held_slabs=held_slabs,
            held_bytes=held_bytes,
            used_bytes=used_bytes,
            peak_held_bytes=peak_held_bytes,
            peak_used_bytes=peak_used_bytes,
            fragmentation=ratio(held_bytes - used_bytes, peak_held_bytes),
            shapes=shapes,
        )
