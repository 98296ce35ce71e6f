"""The workers' side of the cachemgr: typed calls, and the shared memory they map.

:class:`CacheClient` is async (a worker's event loop); :class:`SyncCacheClient`
wraps it for the worker's compute thread, which never runs on the loop.

Mappings: the KV region and the event table are attached read-write at
:meth:`CacheClient.register`; model regions read-only (writes fault) at
:meth:`CacheClient.load_model`, and then *kept* across pins. A resident
region is never written again and its pages live as long as some mapping of
it does, so a kept mapping is safe to read even if the cachemgr evicts the
model meanwhile. (Mapping again at every pin cost each switch an mmap, the
page faults of the first read and, at the unpin, an munmap of the region.)
A kept mapping is dropped once its region's name is gone from /dev/shm
(evicted; the cachemgr never reuses a name): checked at every load and use
report, so a worker holds an evicted model's pages for at most
``use_report_interval_s`` after registering. :meth:`CacheClient.cached_model`
returns a kept mapping without a round trip; the switcher copies from it and
notes the use (:meth:`CacheClient.note_use`), which a task on the loop
reports (LRU recency) on its own schedule, off the switch's critical path.
Nothing is ever unmapped under a live tensor (see ``aegaeon_gpumem.shm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq.asyncio
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import (
    REPLIES,
    AllocBlocks,
    BlocksAllocated,
    BlocksFreed,
    BlocksReassigned,
    CacheStats,
    FreeBlocks,
    GetStats,
    LoadModel,
    ModelLoaded,
    ModelUnpinned,
    ReassignBlocks,
    RegisterWorker,
    UnpinModel,
    UnregisterWorker,
    WorkerRegistered,
    WorkerUnregistered,
)
from aegaeon_common.process import cancel_tasks
from aegaeon_common.transport import RemoteError, RpcClient
from aegaeon_common.wire import Message
from aegaeon_gpumem import EventTable, ShmRegion

from aegaeon_runtime.cacheclient.convert import EventLike, ShapeLike, to_event, to_shape
from aegaeon_runtime.cacheclient.mapped import MappedModel, Registration
from aegaeon_runtime.errors import ModelGoneError, ModelUnavailableError

__all__ = [
    "CacheClient", "EventLike", "ShapeLike", "SyncCacheClient", "model_region", "to_event",
    "to_shape",
]  # fmt: skip

R = TypeVar("R", bound=Message)
T = TypeVar("T")
log = get_logger("cachemgr.client")

# How often noted model uses are reported. Noting one wakes no thread (on the
# 2-core machine a woken loop thread preempted the switch for up to ~10 ms);
# the report's round trip then rarely meets a switch, and all uses of a model
# within an interval cost one. The cachemgr's LRU order lags by up to this.
USE_REPORT_INTERVAL_S = 0.25
# How long a registration waits for an answer. An instance starts beside its cachemgr
# (``aegaeon_cli.node``) and registers once it has built what needs none: its request
# waits in the socket until the cachemgr binds and answers, however slow that start
# (a node's start has a deadline of its own, its supervisor's).
REGISTER_WAIT_S = 600.0


class CacheClient:
    """One worker's connection to the cachemgr (async; use from the worker's event loop).

    ``worker_id`` owns the blocks this client allocates and the models it pins;
    the cachemgr reclaims them when this process dies.
    """

    def __init__(
        self,
        address: str,
        worker_id: str,
        ctx: zmq.asyncio.Context | None = None,
        timeout_s: float = 60.0,
        use_report_interval_s: float = USE_REPORT_INTERVAL_S,
    ) -> None:
        self.address = address
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._rpc = RpcClient(self._ctx, address, REPLIES)
        self._closing = False
        self.registration: Registration | None = None
        # Kept model mappings; read by other threads through cached_model().
        self._models: dict[str, MappedModel] = {}
        self._models_lock = threading.Lock()
        self._uses: set[str] = set()  # noted by any thread, reported by _report_uses
        self._uses_lock = threading.Lock()
        self._use_report_interval_s = use_report_interval_s
        self._reporter: asyncio.Task[None] | None = None
        self._pin_host = False

    def pin_host_memory(self) -> None:
        """Page-lock the regions this client maps from now on (a CUDA worker: its copies
        from and to them are then single DMAs, see ``aegaeon_gpumem.cuda_host``)."""
        self._pin_host = True

    async def _call(
        self, request: Message, reply_type: type[R], timeout_s: float | None = None
    ) -> R:
        reply = await self._rpc.call(request, timeout_s or self.timeout_s)
        if not isinstance(reply, reply_type):
            raise TypeError(f"{request.TAG}: expected {reply_type.TAG}, got {reply.TAG}")
        return reply

    async def register(self, pid: int | None = None, num_event_slots: int = 0) -> Registration:
        """Start this worker's lease; attach the KV region and the event table.

        A second call (e.g. after the cachemgr restarted) starts a new lease:
        the old one's blocks and pins are gone. A cachemgr not up yet is waited
        for (up to :data:`REGISTER_WAIT_S`).
        """
        reply = await self._call(
            RegisterWorker(self.worker_id, os.getpid() if pid is None else pid, num_event_slots,
                           _pid_namespace()),
            WorkerRegistered,
            REGISTER_WAIT_S,
        )
        self._detach()
        kv_region = ShmRegion.attach(reply.kv_region)
        if self._pin_host:
            from aegaeon_gpumem.cuda_host import pin_region

            pin, why = pin_region(kv_region)
            if pin is None:
                log.warning("kv_region_not_pinned", region=kv_region.name, error=why)
        self.registration = Registration(
            worker_id=self.worker_id,
            kv_region=kv_region,
            event_table=EventTable.attach(reply.event_table),
            event_slots=tuple(reply.event_slots),
            slab_bytes=reply.slab_bytes,
        )
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_uses())
        return self.registration

    async def load_model(self, name: str, pin: bool = True) -> MappedModel:
        """The model's region mapped read-only, with its manifest (loads it if needed)."""
        reply = await self._call(LoadModel(name, pin, self.worker_id if pin else ""), ModelLoaded)
        self._drop_evicted()
        with self._models_lock:
            cached = self._models.get(name)
            if cached is None or cached.region.name != reply.region:
                # A replaced mapping is not closed: another thread may be copying from it
                # (its pages go with the last reference).
                cached = self._models[name] = MappedModel.attach(
                    reply, populate=True, pin=self._pin_host)
        return cached.with_reply(reply)

    def cached_model(self, name: str) -> MappedModel | None:
        """The kept mapping of ``name`` if its region is still resident, without a round
        trip (any thread); ``None``: call :meth:`load_model`. Not a pin: see the module
        docstring for why reading it is safe anyway."""
        with self._models_lock:
            model = self._models.get(name)
            if model is not None and not model.region.linked():
                del self._models[name]  # evicted (not closed: see _drop_evicted)
                model = None
        return model

    def note_use(self, name: str) -> None:
        """Note a use of ``name`` (any thread; wakes nothing). Reported (a load without a
        pin: a use in the Model Cache's LRU order) within ``use_report_interval_s`` once
        :meth:`register` started the reporter."""
        with self._uses_lock:
            self._uses.add(name)

    async def _report_uses(self) -> None:
        # stops on its flag too: a cancellation that lands while asyncio.wait_for
        # finishes a touch is swallowed (Python 3.11), and the loop would carry on
        while not self._closing:
            await asyncio.sleep(self._use_report_interval_s)
            with self._uses_lock:
                names, self._uses = self._uses, set()
            for name in sorted(names):
                try:
                    await self.load_model(name, pin=False)
                except (RemoteError, TimeoutError) as exc:
                    log.warning("model_use_report_failed", model=name, error=str(exc))
            self._drop_evicted()

    def _drop_evicted(self) -> None:
        """Forget the mappings whose region the cachemgr unlinked (not closed: a thread
        may still be reading one; the pages go with the last reference)."""
        with self._models_lock:
            for name in [n for n, m in self._models.items() if not m.region.linked()]:
                del self._models[name]

    async def unpin(self, name: str) -> int:
        """Drop one of this worker's pins (the mapping is kept: module docstring).
        Returns the model's remaining pins."""
        reply = await self._call(UnpinModel(name, self.worker_id), ModelUnpinned)
        return reply.pins

    async def alloc_blocks(self, shape: ShapeLike, num_blocks: int) -> BlocksAllocated:
        """``num_blocks`` KV blocks of ``shape`` leased to this worker (offsets into the
        KV region, multiples of ``block_bytes``); RemoteError ``out_of_blocks`` if full."""
        return await self._call(
            AllocBlocks(self.worker_id, to_shape(shape), num_blocks), BlocksAllocated
        )

    async def free_blocks(self, offsets: list[int], event: EventLike | None = None) -> BlocksFreed:
        """Free blocks; with ``event`` (the last copy touching them) they are not
        reallocated before it completes."""
        ref = None if event is None else to_event(event)
        return await self._call(FreeBlocks(self.worker_id, list(offsets), ref), BlocksFreed)

    async def reassign_blocks(
        self, offsets: list[int], new_owner: str, owner: str | None = None
    ) -> int:
        """Move blocks' lease to ``new_owner`` (``owner`` checks the current holder;
        default this worker, ``""`` to skip the check)."""
        held_by = self.worker_id if owner is None else owner
        reply = await self._call(
            ReassignBlocks(list(offsets), new_owner, held_by), BlocksReassigned
        )
        return reply.num_blocks

    async def stats(self) -> CacheStats:
        return await self._call(GetStats(), CacheStats)

    async def unregister(self, timeout_s: float = 2.0) -> None:
        """End the lease now (blocks freed, pins dropped)."""
        if self.registration is not None:
            await self._call(UnregisterWorker(self.worker_id), WorkerUnregistered, timeout_s)
            self.registration = None

    async def close(self, unregister: bool = True) -> None:
        """End the lease (best effort: the cachemgr may be gone) and detach everything."""
        if unregister and self.registration is not None:
            with contextlib.suppress(RemoteError, TimeoutError):
                await self.unregister()
        self._closing = True
        if self._reporter is not None:
            left = await cancel_tasks([self._reporter])
            if left:
                log.warning("tasks_not_cancelled", tasks=left)
            self._reporter = None
        self._detach()
        self._rpc.close()
        if self._own_ctx:  # with any socket left open (term() would wait for it forever)
            self._ctx.destroy(linger=0)

    def _detach(self) -> None:
        with self._models_lock:
            for model in self._models.values():
                model.region.close()
            self._models.clear()
        if self.registration is not None:
            self.registration.close()
            self.registration = None


def _pid_namespace() -> int:
    """This process's PID namespace (``/proc/self/ns/pid``'s inode; 0: unknown): the
    cachemgr watches a worker's pid only in its own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class SyncCacheClient:
    """Blocking facade over a :class:`CacheClient` for threads other than its loop's
    (thread-safe: each call is scheduled on the loop)."""

    def __init__(
        self, client: CacheClient, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None
    ) -> None:
        self.client = client
        self._loop = loop
        self._timeout_s = timeout_s or client.timeout_s + 5.0
        # the threads waiting on a call now (thread ident -> since, monotonic): the compute
        # thread waiting on the cachemgr (a model loading from disk) is not stalled
        # (aegaeon_runtime.liveness)
        self._calling: dict[int, float] = {}

    def calling_since(self, thread: int | None) -> float | None:
        """Since when thread ``thread`` (an ident) waits on a call; None: it does not."""
        return self._calling.get(thread) if thread is not None else None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_running() and _on_loop(self._loop):
            coro.close()
            raise RuntimeError("SyncCacheClient called on its own event loop (would deadlock)")
        me = threading.get_ident()
        self._calling[me] = time.monotonic()  # one key per thread: no two writers race
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)
        finally:
            self._calling.pop(me, None)

    def load_model(self, name: str, pin: bool = True) -> MappedModel:
        return self._run(self.client.load_model(name, pin))

    def cached_model(self, name: str) -> MappedModel | None:
        """:meth:`CacheClient.cached_model` (local: no round trip, no loop hop)."""
        return self.client.cached_model(name)

    def note_use(self, name: str) -> None:
        """:meth:`CacheClient.note_use` (local: no round trip, no loop hop)."""
        self.client.note_use(name)

    def unpin(self, name: str) -> int:
        return self._run(self.client.unpin(name))

    def alloc_blocks(self, shape: ShapeLike, num_blocks: int) -> BlocksAllocated:
        return self._run(self.client.alloc_blocks(shape, num_blocks))

    def free_blocks(self, offsets: list[int], event: EventLike | None = None) -> BlocksFreed:
        return self._run(self.client.free_blocks(offsets, event))

    def reassign_blocks(self, offsets: list[int], new_owner: str, owner: str | None = None) -> int:
        return self._run(self.client.reassign_blocks(offsets, new_owner, owner))

    def stats(self) -> CacheStats:
        return self._run(self.client.stats())


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def model_region(cache: SyncCacheClient, name: str) -> MappedModel:
    """``name``'s Model Cache region (a model's or an adapter's): the client's kept
    mapping (the use is noted, reported later by the client), else (first use, or
    evicted since) mapped under a pin that is dropped at once; a kept mapping is safe
    to read unpinned (see the module docstring). ``ModelGoneError`` when the cachemgr
    no longer holds it, ``ModelUnavailableError`` when it cannot read its checkpoint."""
    mapped = cache.cached_model(name)
    if mapped is not None:
        cache.note_use(name)
        return mapped
    try:
        mapped = cache.load_model(name, pin=True)
    except RemoteError as exc:
        if exc.code == "unknown_model":
            raise ModelGoneError(name, str(exc)) from exc
        if exc.code == "checkpoint_error":  # quarantined by the cachemgr
            raise ModelUnavailableError(name, exc.reply.message) from exc
        raise
    cache.unpin(name)
    return mapped
