"""Typed errors of the memory layer.

Every error a caller may want to handle has its own type and carries the
numbers it names in its message as attributes, so callers (the decode
service's admission control, the cachemgr's replies) never parse messages.
"""

from __future__ import annotations

from collections.abc import Hashable


class GpuMemError(Exception):
    """Base class of every error raised by `aegaeon_gpumem`."""


class OutOfDeviceMemory(GpuMemError, MemoryError):  # noqa: N818 (the name is the contract)
    """The weights arena cannot fit an allocation."""

    def __init__(self, capacity_bytes: int, used_bytes: int, requested_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = used_bytes
        self.requested_bytes = requested_bytes
        super().__init__(
            f"out of device memory: requested {requested_bytes} bytes, "
            f"used {used_bytes} of {capacity_bytes} bytes "
            f"({capacity_bytes - used_bytes} free before alignment)"
        )


class OutOfBlocks(GpuMemError, MemoryError):  # noqa: N818 (the name is the contract)
    """A slab region cannot serve a block request (nothing was allocated)."""

    def __init__(
        self,
        shape_key: Hashable,
        block_bytes: int,
        *,
        requested_blocks: int,
        available_blocks: int,
        capacity_blocks: int,
        capacity_bytes: int,
    ) -> None:
        self.shape_key = shape_key
        self.block_bytes = block_bytes
        self.requested_blocks = requested_blocks
        self.available_blocks = available_blocks
        self.capacity_blocks = capacity_blocks
        self.capacity_bytes = capacity_bytes
        super().__init__(
            f"out of KV blocks for shape {shape_key!r}: requested {requested_blocks} blocks "
            f"of {block_bytes} bytes ({requested_blocks * block_bytes} bytes), "
            f"{available_blocks} available now; the region holds at most "
            f"{capacity_blocks} blocks of this shape ({capacity_bytes} bytes)"
        )


class BlockTooLargeError(GpuMemError, ValueError):
    """A block does not fit in one slab (block_bytes > slab_bytes)."""

    def __init__(self, block_bytes: int, slab_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slab_bytes = slab_bytes
        super().__init__(
            f"block of {block_bytes} bytes does not fit in a slab of {slab_bytes} bytes"
        )


class InvalidFreeError(GpuMemError, ValueError):
    """An offset given to `free` is not an allocated block (double free, bad offset)."""


class IntegrityError(GpuMemError):
    """An allocator invariant is broken (raised by `check_integrity`)."""


class EventTimeoutError(GpuMemError, TimeoutError):
    """An event did not complete within the allowed time."""


class BadEventHandleError(GpuMemError, ValueError):
    """A serialised event handle has a wrong kind or field."""


class CopyStreamError(GpuMemError):
    """A copy stream failed; later work on it never runs and its events never complete."""
