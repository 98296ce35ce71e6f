"""aegaeon_gpumem: device buffers, slab-allocated KV blocks, copies and events.

One API, two backends: CPU (process memory, POSIX shared memory, timeline
tables of shared counters) and CUDA (one cudaMalloc'd buffer, pinned stage
buffer, IPC events through torch). Bookkeeping (`BumpArena`,
`SlabAllocator`, `MoveList`) is pure; a thin layer touches memory.
"""

from __future__ import annotations

from aegaeon_gpumem.arena import DEFAULT_ALIGN, Allocation, ArenaStats, BumpArena
from aegaeon_gpumem.backend import copy_chunked, make_copy_stream
from aegaeon_gpumem.copies import CopyPair, CopyStream, CpuCopyStream, coalesce, copy_blocks
from aegaeon_gpumem.cuda_events import CudaEvent  # also registers the "cuda" opener
from aegaeon_gpumem.device_buffer import DeviceBuffer, promote_copy
from aegaeon_gpumem.errors import (
    BadEventHandleError,
    BlockTooLargeError,
    CopyStreamError,
    EventTimeoutError,
    GpuMemError,
    IntegrityError,
    InvalidFreeError,
    OutOfBlocks,
    OutOfDeviceMemory,
)
from aegaeon_gpumem.event_table import EventTable, Timeline
from aegaeon_gpumem.events import (
    CpuEvent,
    Event,
    EventHandle,
    open_event,
    open_host_event,
)
from aegaeon_gpumem.kv_pool import KVBlockPool, KVPoolStats
from aegaeon_gpumem.memcopy import (
    CPU_CHUNK_BYTES,
    CPU_COPY_THREADS,
    byte_copy,
    flat_bytes,
)
from aegaeon_gpumem.move_list import MoveList
from aegaeon_gpumem.shm import ShmRegion, cleanup_prefix, list_segments, unique_name
from aegaeon_gpumem.slab import ShapeStats, SlabAllocator, SlabStats, suggest_slab_bytes

__all__ = [
    "CPU_CHUNK_BYTES",
    "CPU_COPY_THREADS",
    "DEFAULT_ALIGN",
    "Allocation",
    "ArenaStats",
    "BadEventHandleError",
    "BlockTooLargeError",
    "BumpArena",
    "CopyPair",
    "CopyStream",
    "CopyStreamError",
    "CpuCopyStream",
    "CpuEvent",
    "CudaEvent",
    "DeviceBuffer",
    "Event",
    "EventHandle",
    "EventTable",
    "EventTimeoutError",
    "GpuMemError",
    "IntegrityError",
    "InvalidFreeError",
    "KVBlockPool",
    "KVPoolStats",
    "MoveList",
    "OutOfBlocks",
    "OutOfDeviceMemory",
    "ShapeStats",
    "ShmRegion",
    "SlabAllocator",
    "SlabStats",
    "Timeline",
    "byte_copy",
    "cleanup_prefix",
    "coalesce",
    "copy_blocks",
    "copy_chunked",
    "flat_bytes",
    "list_segments",
    "make_copy_stream",
    "open_event",
    "open_host_event",
    "promote_copy",
    "suggest_slab_bytes",
    "unique_name",
]
