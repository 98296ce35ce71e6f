"""Worker <-> cachemgr request-reply messages (one ROUTER on ``Config.cachemgr_address``).

Structs only. Sizes are bytes, offsets are byte offsets into the unified KV
region (multiples of the shape's ``block_bytes``), times are seconds. Errors
come back as :class:`~aegaeon_common.messages.common.ErrorReply` with a code
from :data:`ERROR_CODES`.
"""

from __future__ import annotations

import msgspec

from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_common.wire import Channel, Message, Struct

# ErrorReply codes the cachemgr answers with (besides the wire's own:
# malformed, bad_version, unknown_tag, bad_field, missing_field).
ERROR_CODES = (
    "bad_request",  # a well-formed request the cache cannot act on (bad shape, bad offsets)
    "unknown_model",  # not a model of the config
    # missing or corrupt checkpoint files; the cache is unchanged and the model
    # unavailable (every load refused with this error) until ReloadModel
    "checkpoint_error",
    "model_cache_full",  # pinned models leave no room under the budget
    "not_pinned",  # UnpinModel of a model the caller has not pinned
    "out_of_blocks",  # the KV region cannot serve the request; detail names capacity
    "unknown_owner",  # owner is not a registered worker
    "not_owner",  # blocks are leased to another owner
    "shutting_down",
    "internal",
)


# ---- shared structs --------------------------------------------------------


class TensorEntry(Struct, frozen=True):
    """One tensor of a model region (the engine's packed weight layout)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


# ---- requests --------------------------------------------------------------


class RegisterWorker(Message, frozen=True):
    """Start (or restart) the lease of ``worker_id``; a previous lease is ended first.

    ``pid`` is watched (every ~0.5 s): when it dies, its blocks, pins and event
    slots are reclaimed. ``pid=0`` means not watched (lease ends on
    :class:`UnregisterWorker` only), and so does a ``pid`` of another PID namespace
    than the cachemgr's (``pid_namespace``: the worker's ``/proc/self/ns/pid``
    inode; a container of its own: that number is not a process the cachemgr sees).
    """

    TAG = "cache.register_worker"
    worker_id: str
    pid: int
    num_event_slots: int = 0  # 0: the cachemgr's default
    pid_namespace: int = 0  # 0: unknown (taken as the cachemgr's own)


class UnregisterWorker(Message, frozen=True):
    """End ``worker_id``'s lease now: free its blocks, drop its pins and slots."""

    TAG = "cache.unregister_worker"
    worker_id: str


class LoadModel(Message, frozen=True):
    """Make ``name`` resident in the Model Cache (loading it if needed); pin it for
    ``worker_id`` when ``pin`` (a pinned model is never evicted)."""

    TAG = "cache.load_model"
    name: str
    pin: bool = True
    worker_id: str = ""  # "" pins anonymously (released only by UnpinModel)


class UnpinModel(Message, frozen=True):
    TAG = "cache.unpin_model"
    name: str
    worker_id: str = ""


class AllocBlocks(Message, frozen=True):
    """``num_blocks`` blocks of ``shape`` in the unified KV cache, leased to ``owner``."""

    TAG = "cache.alloc_blocks"
    owner: str
    shape: KVShapeSpec
    num_blocks: int


class FreeBlocks(Message, frozen=True):
    """Free blocks; with ``event`` they wait in the move list until it completes."""

    TAG = "cache.free_blocks"
    owner: str
    offsets: list[int]
    event: EventSpec | None = None


class ReassignBlocks(Message, frozen=True):
    """Move the lease of blocks to ``new_owner`` (a prefill hands KV to a decode)."""

    TAG = "cache.reassign_blocks"
    offsets: list[int]
    new_owner: str
    owner: str = ""  # when given, every block must be leased to it


class GetStats(Message, frozen=True):
    """Occupancy of both caches; also the readiness probe."""

    TAG = "cache.get_stats"


class RegisterModel(Message, frozen=True):
    """Serve one more model (its checkpoint at ``path``) without a restart; idempotent."""

    TAG = "cache.register_model"
    name: str
    path: str


class ForgetModel(Message, frozen=True):
    """Stop serving ``name``: no new loads; its operator pin is dropped and it is
    evicted as soon as no worker pins it (the proxy sends this once its last
    request has finished)."""

    TAG = "cache.forget_model"
    name: str


class SetModelFlags(Message, frozen=True):
    """The operator's wishes for a model: ``pinned`` (an operator pin: never evicted)
    and ``preload`` (load it now if it is not resident). A load starts in the
    background; the reply does not wait for it (``ModelFlagsSet.progress``)."""

    TAG = "cache.set_model_flags"
    name: str
    pinned: bool = False
    preload: bool = False


class ReloadModel(Message, frozen=True):
    """Read ``name``'s checkpoint (at ``path``) again: an unavailable model's quarantine
    is lifted, its files checked (sizes, headers) and it is loaded with its digests
    checked; the reply comes once that load ended (``checkpoint_error``: it is
    unavailable again, with what is wrong now)."""

    TAG = "cache.reload_model"
    name: str
    path: str


# ---- replies ---------------------------------------------------------------


class WorkerRegistered(Message, frozen=True):
    TAG = "cache.worker_registered"
    kv_region: str  # shared-memory name of the unified KV region
    kv_region_bytes: int
    event_table: str  # shared-memory name of the event table
    event_slots: list[int]  # this worker's slots in the table
    slab_bytes: int = 0


class WorkerUnregistered(Message, frozen=True):
    TAG = "cache.worker_unregistered"
    num_blocks_freed: int


class ModelLoaded(Message, frozen=True):
    """A resident model: map ``region`` read-only; tensors at their offsets."""

    TAG = "cache.model_loaded"
    name: str
    region: str
    nbytes: int
    dtype: str
    tensors: list[TensorEntry]
    load_s: float = 0.0  # how long the disk load took (0 if it was resident)
    hit: bool = False  # it was already resident


class ModelUnpinned(Message, frozen=True):
    TAG = "cache.model_unpinned"
    name: str
    pins: int  # remaining pins of every owner


class ModelRegistered(Message, frozen=True):
    TAG = "cache.model_registered"
    name: str


class ModelForgotten(Message, frozen=True):
    TAG = "cache.model_forgotten"
    name: str
    evicted: bool  # out of the Model Cache now (else once its last worker pin goes)


class ModelReloaded(Message, frozen=True):
    TAG = "cache.model_reloaded"
    name: str
    resident: bool  # loaded (and checked) now; False: no room in the Model Cache to try


class ModelFlagsSet(Message, frozen=True):
    TAG = "cache.model_flags_set"
    name: str
    pinned: bool
    resident: bool
    progress: float  # share of its bytes in the Model Cache (1.0: resident)


class BlocksAllocated(Message, frozen=True):
    TAG = "cache.blocks_allocated"
    offsets: list[int]
    block_bytes: int


class BlocksFreed(Message, frozen=True):
    TAG = "cache.blocks_freed"
    num_freed: int  # back in the free pool now
    num_deferred: int  # in the move list until the event completes


class BlocksReassigned(Message, frozen=True):
    TAG = "cache.blocks_reassigned"
    num_blocks: int


class ResidentModel(Struct, frozen=True):
    name: str
    region: str
    nbytes: int
    pins: int
    load_s: float


class ModelCacheStats(Struct, frozen=True):
    budget_bytes: int
    used_bytes: int  # resident + being loaded
    models: list[ResidentModel]  # least recently used first
    loading: list[str]
    num_loads: int
    num_hits: int
    num_evictions: int
    load_s_total: float
    loaded_bytes_total: int
    # model -> share of its bytes filled, for loads in progress (0..1)
    progress: dict[str, float] = msgspec.field(default_factory=dict)
    operator_pinned: list[str] = msgspec.field(default_factory=list)  # SetModelFlags(pinned)
    known: list[str] = msgspec.field(default_factory=list)  # models it may load
    # model -> why its checkpoint cannot be read (loads refused until ReloadModel)
    unavailable: dict[str, str] = msgspec.field(default_factory=dict)


class ShapeCount(Struct, frozen=True):
    shape: KVShapeSpec
    block_bytes: int
    used_blocks: int
    held_slabs: int
    fragmentation: float


class KVCacheStats(Struct, frozen=True):
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
    # blocks freed since start: at once, and behind a copy's event still in flight
    freed_blocks: int = 0
    deferred_blocks: int = 0


class WorkerInfo(Struct, frozen=True):
    worker_id: str
    pid: int
    event_slots: list[int]
    num_blocks: int
    pinned: list[str]


class CacheStats(Message, frozen=True):
    TAG = "cache.stats"
    model_cache: ModelCacheStats
    kv: KVCacheStats
    workers: list[WorkerInfo] = msgspec.field(default_factory=list)
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
        RegisterModel,
        ForgetModel,
        SetModelFlags,
        ReloadModel,
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
        ModelRegistered,
        ModelForgotten,
        ModelFlagsSet,
        ModelReloaded,
    ],
)
