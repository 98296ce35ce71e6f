"""Worker <-> cachemgr request-reply messages (one ROUTER on ``Config.cachemgr_address``).

Structs only. Sizes are bytes, offsets are byte offsets into the unified KV
region (multiples of the shape's ``block_bytes``), times are seconds. Errors
come back as :class:`~aegaeon_common.messages.common.ErrorReply` with a code
from :data:`ERROR_CODES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_common.wire import Channel, Message, Struct

# ErrorReply codes the cachemgr answers with (besides the wire's own:
# malformed, bad_version, unknown_tag, bad_field, missing_field).
ERROR_CODES = (
    "bad_request",  # a well-formed request the cache cannot act on (bad shape, bad offsets)
    "unknown_model",  # not a model of the config
    "checkpoint_error",  # missing or corrupt checkpoint files; the cache is unchanged
    "model_cache_full",  # pinned models leave no room under the budget
    "not_pinned",  # UnpinModel of a model the caller has not pinned
    "out_of_blocks",  # the KV region cannot serve the request; detail names capacity
    "unknown_owner",  # owner is not a registered worker
    "not_owner",  # blocks are leased to another owner
    "shutting_down",
    "internal",
)


# ---- shared structs --------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry(Struct):
    """One tensor of a model region (the engine's packed weight layout)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


# ---- requests --------------------------------------------------------------


@dataclass(frozen=True)
class RegisterWorker(Message):
    """Start (or restart) the lease of ``worker_id``; a previous lease is ended first.

    ``pid`` is watched (every ~0.5 s): when it dies, its blocks, pins and event
    slots are reclaimed. ``pid=0`` means not watched (lease ends on
    :class:`UnregisterWorker` only).
    """

    TAG = "cache.register_worker"
    worker_id: str
    pid: int
    num_event_slots: int = 0  # 0: the cachemgr's default


@dataclass(frozen=True)
class UnregisterWorker(Message):
    """End ``worker_id``'s lease now: free its blocks, drop its pins and slots."""

    TAG = "cache.unregister_worker"
    worker_id: str


@dataclass(frozen=True)
class LoadModel(Message):
    """Make ``name`` resident in the Model Cache (loading it if needed); pin it for
    ``worker_id`` when ``pin`` (a pinned model is never evicted)."""

    TAG = "cache.load_model"
    name: str
    pin: bool = True
    worker_id: str = ""  # "" pins anonymously (released only by UnpinModel)


@dataclass(frozen=True)
class UnpinModel(Message):
    TAG = "cache.unpin_model"
    name: str
    worker_id: str = ""


@dataclass(frozen=True)
class AllocBlocks(Message):
    """``num_blocks`` blocks of ``shape`` in the unified KV cache, leased to ``owner``."""

    TAG = "cache.alloc_blocks"
    owner: str
    shape: KVShapeSpec
    num_blocks: int


@dataclass(frozen=True)
class FreeBlocks(Message):
    """Free blocks; with ``event`` they wait in the move list until it completes."""

    TAG = "cache.free_blocks"
    owner: str
    offsets: list[int]
    event: EventSpec | None = None


@dataclass(frozen=True)
class ReassignBlocks(Message):
    """Move the lease of blocks to ``new_owner`` (a prefill hands KV to a decode)."""

    TAG = "cache.reassign_blocks"
    offsets: list[int]
    new_owner: str
    owner: str = ""  # when given, every block must be leased to it


@dataclass(frozen=True)
class GetStats(Message):
    """Occupancy of both caches; also the readiness probe."""

    TAG = "cache.get_stats"


# ---- replies ---------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRegistered(Message):
    TAG = "cache.worker_registered"
    kv_region: str  # shared-memory name of the unified KV region
    kv_region_bytes: int
    event_table: str  # shared-memory name of the event table
    event_slots: list[int]  # this worker's slots in the table
    slab_bytes: int = 0


@dataclass(frozen=True)
class WorkerUnregistered(Message):
    TAG = "cache.worker_unregistered"
    num_blocks_freed: int


@dataclass(frozen=True)
class ModelLoaded(Message):
    """A resident model: map ``region`` read-only; tensors at their offsets."""

    TAG = "cache.model_loaded"
    name: str
    region: str
    nbytes: int
    dtype: str
    tensors: list[TensorEntry]
    load_s: float = 0.0  # how long the disk load took (0 if it was resident)
    hit: bool = False  # it was already resident


@dataclass(frozen=True)
class ModelUnpinned(Message):
    TAG = "cache.model_unpinned"
    name: str
    pins: int  # remaining pins of every owner


@dataclass(frozen=True)
class BlocksAllocated(Message):
    TAG = "cache.blocks_allocated"
    offsets: list[int]
    block_bytes: int


@dataclass(frozen=True)
class BlocksFreed(Message):
    TAG = "cache.blocks_freed"
    num_freed: int  # back in the free pool now
    num_deferred: int  # in the move list until the event completes


@dataclass(frozen=True)
class BlocksReassigned(Message):
    TAG = "cache.blocks_reassigned"
    num_blocks: int


@dataclass(frozen=True)
class ResidentModel(Struct):
    name: str
    region: str
    nbytes: int
    pins: int
    load_s: float


@dataclass(frozen=True)
class ModelCacheStats(Struct):
    budget_bytes: int
    used_bytes: int  # resident + being loaded
    models: list[ResidentModel]  # least recently used first
    loading: list[str]
    num_loads: int
    num_hits: int
    num_evictions: int
    load_s_total: float
    loaded_bytes_total: int


@dataclass(frozen=True)
class ShapeCount(Struct):
    shape: KVShapeSpec
    block_bytes: int
    used_blocks: int
    held_slabs: int
    fragmentation: float


@dataclass(frozen=True)
class KVCacheStats(Struct):
    capacity_bytes: int
    slab_bytes: int
    used_bytes: int  # bytes of live blocks
    held_bytes: int  # bytes of slabs assigned to a shape
    peak_used_bytes: int
    peak_held_bytes: int
    fragmentation: float  # (held - used) / peak held
    blocks_per_owner: dict[str, int]
    move_list_blocks: int
    shapes: list[ShapeCount]


@dataclass(frozen=True)
class WorkerInfo(Struct):
    worker_id: str
    pid: int
    event_slots: list[int]
    num_blocks: int
    pinned: list[str]


@dataclass(frozen=True)
class CacheStats(Message):
    TAG = "cache.stats"
    model_cache: ModelCacheStats
    kv: KVCacheStats
    workers: list[WorkerInfo] = field(default_factory=list)
    uptime_s: float = 0.0


REQUESTS = Channel(
    "cachemgr.requests",
    [
        RegisterWorker,
        UnregisterWorker,
        LoadModel,
        UnpinModel,
        AllocBlocks,
        FreeBlocks,
        ReassignBlocks,
        GetStats,
    ],
)
REPLIES = Channel(
    "cachemgr.replies",
    [
        WorkerRegistered,
        WorkerUnregistered,
        ModelLoaded,
        ModelUnpinned,
        BlocksAllocated,
        BlocksFreed,
        BlocksReassigned,
        CacheStats,
    ],
)
