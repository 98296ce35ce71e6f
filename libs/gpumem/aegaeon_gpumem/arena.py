"""Bump allocation over a byte range: pure bookkeeping, no tensors.

The weights arena of a device buffer. Allocations are made consecutively by
bumping a pointer; deallocation is moving the pointer back (`release_to`,
`reset`). There is no per-allocation free, so there is no fragmentation.

Invariants (checked by `check_integrity`):
  0 <= top <= capacity_bytes; top <= peak <= capacity_bytes;
  every live allocation lies in [0, top) and they are ordered and disjoint
  (zero-byte allocations own nothing and are not tracked).
"""

from __future__ import annotations

from dataclasses import dataclass

from aegaeon_gpumem.errors import IntegrityError, OutOfDeviceMemory

DEFAULT_ALIGN = 256


def align_up(value: int, align: int) -> int:
    """Smallest multiple of `align` (a power of two) that is >= value."""
    return (value + align - 1) & ~(align - 1)


def _check_align(align: int) -> int:
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment must be a positive power of two, got {align}")
    return align


@dataclass(frozen=True, slots=True)
class Allocation:
    """A byte range [offset, offset + nbytes) of a buffer."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """Occupancy of a bump arena, in bytes (`free_bytes` = capacity - used)."""

    capacity_bytes: int
    used_bytes: int
    peak_bytes: int
    free_bytes: int


class BumpArena:
    """Bump allocator over offsets [0, capacity_bytes).

    Offsets are relative to the arena start; alignment is relative too (the
    device buffer places the arena at a page-aligned address so relative and
    absolute alignment agree for alignments up to a page).
    """

    def __init__(self, capacity_bytes: int, default_align: int = DEFAULT_ALIGN) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"arena capacity must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._default_align = _check_align(default_align)
        self._top = 0
        self._peak = 0
        # Live allocations of at least one byte in order, to answer
        # `allocations()` and check integrity; trimmed by release_to/reset.
        self._live: list[Allocation] = []

    @property
    def capacity_bytes(self) -> int:
        """Bytes managed by the arena."""
        return self._capacity

    @property
    def top(self) -> int:
        """The bump pointer: first byte not used by a live allocation."""
        return self._top

    def fits(self, nbytes: int, align: int | None = None) -> bool:
        """True if `alloc(nbytes, align)` would succeed now."""
        offset = align_up(self._top, _check_align(align or self._default_align))
        return nbytes >= 0 and offset + nbytes <= self._capacity

    def alloc(self, nbytes: int, align: int | None = None) -> Allocation:
        """Allocate `nbytes` at the next multiple of `align` (default 256).

        Raises OutOfDeviceMemory (nothing changes) if it does not fit.
        """
        if nbytes < 0:
            raise ValueError(f"allocation size must be >= 0, got {nbytes}")
        offset = align_up(self._top, _check_align(align or self._default_align))
        return self._take(offset, nbytes, self._top)

    def alloc_at(self, offset: int, nbytes: int) -> Allocation:
        """Allocate ``[offset, offset + nbytes)`` at or above the bump pointer (a place
        chosen by the caller, e.g. where a model's CUDA graphs were captured); the
        pointer moves past it. Raises OutOfDeviceMemory (nothing changes) if it does
        not fit, ValueError below the pointer."""
        if nbytes < 0 or offset < self._top:
            raise ValueError(f"alloc_at({offset}, {nbytes}) below the bump pointer {self._top}")
        return self._take(offset, nbytes, offset)

    def _take(self, offset: int, nbytes: int, used_bytes: int) -> Allocation:
        """``[offset, offset + nbytes)``, the pointer past it; OutOfDeviceMemory naming
        ``used_bytes`` (nothing changes) if it does not fit."""
        if offset + nbytes > self._capacity:
            raise OutOfDeviceMemory(self._capacity, used_bytes, nbytes)
        allocation = Allocation(offset, nbytes)
        self._top = offset + nbytes
        self._peak = max(self._peak, self._top)
        if nbytes:
            self._live.append(allocation)  # zero-byte allocations own nothing
        return allocation

    def mark(self) -> int:
        """The current bump pointer, to pass to `release_to` later."""
        return self._top

    def release_to(self, mark: int) -> None:
        """Free every allocation made after `mark` was taken (pointer moves back).

        `mark` must be <= the current pointer; allocations that straddle it
        (impossible for marks from `mark()`) are dropped too.
        """
        if not 0 <= mark <= self._top:
            raise ValueError(f"mark {mark} is not in [0, {self._top}]")
        self._top = mark
        while self._live and self._live[-1].end > mark:
            self._live.pop()

    def reset(self) -> None:
        """Free everything (pointer back to 0)."""
        self.release_to(0)

    def set_top(self, allocation: Allocation) -> None:
        """Make `allocation` the last live one: drop later ones and any overlapping it.

        Used after a promote moved bytes down: the arena then holds exactly the
        allocations below `allocation.offset` plus `allocation` itself.
        """
        if allocation.offset < 0 or allocation.end > self._capacity:
            raise ValueError(f"{allocation} is outside the arena [0, {self._capacity})")
        while self._live and self._live[-1].end > allocation.offset:
            self._live.pop()
        if allocation.nbytes:
            self._live.append(allocation)
        self._top = allocation.end
        self._peak = max(self._peak, self._top)

    def allocations(self) -> list[Allocation]:
        """The live allocations, lowest offset first."""
        return list(self._live)

    def stats(self) -> ArenaStats:
        """Capacity, used (= bump pointer), peak and free bytes."""
        return ArenaStats(self._capacity, self._top, self._peak, self._capacity - self._top)

    def check_integrity(self) -> None:
        """Raise IntegrityError if an invariant (module docstring) is broken."""
        if not 0 <= self._top <= self._peak <= self._capacity:
            raise IntegrityError(
                f"arena pointers out of order: top {self._top}, peak {self._peak}, "
                f"capacity {self._capacity}"
            )
        end = 0
        for allocation in self._live:
            if allocation.offset < end or allocation.nbytes < 0:
                raise IntegrityError(f"arena allocation {allocation} overlaps its predecessor")
            end = allocation.end
        if end > self._top:
            raise IntegrityError(f"arena allocation ends at {end}, above the pointer {self._top}")
