"""The cachemgr's state and its request handlers (one per message type, by table).

Owns every shared-memory segment of the run: the unified KV region, the
event table and the Model Cache regions; ``close`` unlinks them all. Leases
tie blocks, pins and event slots to registered workers; a worker that dies
(``reap_dead``) or registers again has its old lease reclaimed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.market_files import MarketRecords
from aegaeon_common.messages.cache import (
    AllocBlocks,
    BlocksAllocated,
    BlocksFreed,
    BlocksReassigned,
    CacheStats,
    ForgetModel,
    FreeBlocks,
    GetStats,
    LoadModel,
    ModelFlagsSet,
    ModelForgotten,
    ModelLoaded,
    ModelRegistered,
    ModelReloaded,
    ModelUnpinned,
    ReassignBlocks,
    RegisterModel,
    RegisterWorker,
    ReloadModel,
    SetModelFlags,
    UnpinModel,
    UnregisterWorker,
    WorkerInfo,
    WorkerRegistered,
    WorkerUnregistered,
)
from aegaeon_common.owner import stamp
from aegaeon_common.wire import Message
from aegaeon_gpumem import EventTable, ShmRegion
from prometheus_client import Counter

from aegaeon_cachemgr.errors import CacheError
from aegaeon_cachemgr.kv_cache import UnifiedKVCache
from aegaeon_cachemgr.model_cache import ModelCache, reserve_pages
from aegaeon_cachemgr.workers import Lease, WorkerRegistry

log = get_logger("cachemgr")

DEFAULT_SLOTS_PER_WORKER = 4  # one timeline per copy stream; a worker runs 2-3


class CacheManager:
    """Model Cache + unified KV cache + worker leases, behind typed requests."""

    def __init__(
        self, config: Config, executor: Executor, requests: Counter | None = None
    ) -> None:
        """``requests``: counts each answered request by tag and outcome (/metrics)."""
        self.requests = requests
        cache = config.cache
        # Names are unique per cachemgr process: a worker's cached attachment by
        # name (gpumem's event tables) must never meet a recreated segment.
        # (its stamp, HOST-TAG.PID: `aegaeon market gc` removes those of a cachemgr gone)
        prefix = f"{config.shm_prefix}-{stamp()}-{secrets.token_hex(3)}-"
        self.started = time.monotonic()
        self.kv_region = ShmRegion.create(f"{prefix}kv", cache.kv_cache_bytes)
        try:
            # Commit the pages now: a full /dev/shm fails here, not as SIGBUS in a worker.
            reserve_pages(self.kv_region.name, self.kv_region.nbytes)
            self.events = EventTable.create(f"{prefix}events", cache.event_slots)
        except BaseException:
            self.kv_region.close()
            raise
        self.kv = UnifiedKVCache(self.kv_region, cache.slab_bytes, self.events.name)
        models = {m.name: m.path for m in config.models}
        # what market.json records of each model's files (sizes, digests)
        self.records = MarketRecords(config.market_dir)
        self.models = ModelCache(models, config.dtype, cache.model_cache_bytes, prefix, executor,
                                 self.records.files, tp=config.prefill.tp)  # fmt: skip
        per_worker = min(DEFAULT_SLOTS_PER_WORKER, cache.event_slots)
        self.workers = WorkerRegistry(cache.event_slots, per_worker)
        self._handlers: dict[type[Message], Callable[[Any], Awaitable[Message]]] = {
            RegisterWorker: self._register,
            UnregisterWorker: self._unregister,
            LoadModel: self._load,
            UnpinModel: self._unpin,
            AllocBlocks: self._alloc,
            FreeBlocks: self._free,
            ReassignBlocks: self._reassign,
            GetStats: self._stats,
            RegisterModel: self._register_model,
            ForgetModel: self._forget_model,
            SetModelFlags: self._set_flags,
            ReloadModel: self._reload_model,
        }

    async def handle(self, request: Message) -> Message:
        """Answer one decoded request; a refused one gets its ``ErrorReply``."""
        outcome = "internal"  # until it is answered (an unexpected error propagates)
        try:
            reply = await self._handlers[type(request)](request)
            outcome = "ok"
            return reply
        except CacheError as exc:
            outcome = exc.code
            return exc.reply()
        finally:
            if self.requests is not None:
                self.requests.labels(request.TAG, outcome).inc()

    # ---- leases ---------------------------------------------------------

    def _require(self, worker_id: str, what: str) -> Lease:
        lease = self.workers.get(worker_id)
        if lease is None:
            raise CacheError(
                "unknown_owner",
                f"{what} {worker_id!r} is not a registered worker (RegisterWorker first)",
                {"owner": worker_id},
            )
        return lease

    def _release(self, worker_id: str) -> int:
        """Reclaim what ``worker_id`` holds: its blocks (freed now) and its pins."""
        freed = self.kv.release_owner(worker_id)
        unpinned = self.models.release_owner(worker_id)
        if freed or unpinned:
            log.info("lease_reclaimed", worker=worker_id, blocks=freed, unpinned=unpinned)
        return freed

    def reap_dead(self) -> list[str]:
        """End the leases of workers whose process died; return their ids."""
        dead = self.workers.dead()
        for lease in dead:
            log.warning("worker_died", worker=lease.worker_id, pid=lease.pid)
            self._release(lease.worker_id)
            self.workers.end(lease.worker_id)
        return [lease.worker_id for lease in dead]

    async def _register(self, req: RegisterWorker) -> Message:
        if req.worker_id in self.workers:
            # A restarted worker: nothing of its previous process is in flight.
            self._release(req.worker_id)
        lease, _ = self.workers.register(req.worker_id, req.pid, req.num_event_slots,
                                         req.pid_namespace)  # fmt: skip
        log.info(
            "worker_registered",
            worker=req.worker_id,
            pid=req.pid,
            slots=list(lease.slots),
            # not watched: pid 0, or a process of another PID namespace (a container of
            # its own): its lease ends when it unregisters or registers again
            watched=lease.create_time is not None,
        )
        return WorkerRegistered(
            kv_region=self.kv_region.name,
            kv_region_bytes=self.kv_region.nbytes,
            event_table=self.events.name,
            event_slots=list(lease.slots),
            slab_bytes=self.kv.slab_bytes,
        )

    async def _unregister(self, req: UnregisterWorker) -> Message:
        self._require(req.worker_id, "worker")
        freed = self._release(req.worker_id)
        self.workers.end(req.worker_id)
        return WorkerUnregistered(freed)

    # ---- Model Cache ----------------------------------------------------

    async def _load(self, req: LoadModel) -> Message:
        lease = self._require(req.worker_id, "worker") if req.worker_id else None
        entry, hit = await self.models.acquire(req.name, req.worker_id, req.pin)
        if lease is not None and req.pin and self.workers.get(req.worker_id) is not lease:
            # The worker died (or restarted) while the load ran: its pin has no holder.
            self.models.release_owner(req.worker_id)
        plan = entry.plan
        return ModelLoaded(
            name=req.name,
            region=entry.region.name,
            nbytes=plan.nbytes,
            dtype=plan.dtype,
            tensors=plan.tensors,
            load_s=0.0 if hit else entry.load_s,
            hit=hit,
        )

    async def _unpin(self, req: UnpinModel) -> Message:
        return ModelUnpinned(req.name, self.models.unpin(req.name, req.worker_id))

    # ---- models at run time (the proxy's admin endpoints) ----------------

    async def check_models(self) -> None:
        """Check every model's checkpoint (sizes, headers; off the loop), quarantining
        those that cannot be read: at start, before any worker asks."""
        for name, exc in (await asyncio.to_thread(self.models.check_all)).items():
            self.models.quarantine(name, exc.message)

    async def _check(self, name: str) -> None:
        """``name`` registered or reloaded: refused (``checkpoint_error``, and quarantined)
        when its files or headers are wrong."""
        exc = await asyncio.to_thread(self.models.check, name)
        if exc is not None:
            self.models.quarantine(name, exc.message)
            raise exc

    async def _register_model(self, req: RegisterModel) -> Message:
        self.models.register(req.name, Path(req.path))
        log.info("model_registered", model=req.name, path=req.path)
        why = self.models.unavailable.get(req.name)
        if why is not None:  # registered again (an instance restarted): still unreadable
            raise CacheError("checkpoint_error", why, {"model": req.name})
        await self._check(req.name)
        return ModelRegistered(req.name)

    async def _reload_model(self, req: ReloadModel) -> Message:
        self.models.reload(req.name, Path(req.path))
        await self._check(req.name)
        try:
            await self.models.acquire(req.name, "", pin=False)
        except CacheError as exc:
            if exc.code != "model_cache_full":
                raise
            return ModelReloaded(req.name, resident=False)  # checked at its first load
        return ModelReloaded(req.name, resident=True)

    async def _forget_model(self, req: ForgetModel) -> Message:
        evicted = self.models.forget(req.name)
        log.info("model_forgotten", model=req.name, evicted=evicted)
        return ModelForgotten(req.name, evicted)

    async def _set_flags(self, req: SetModelFlags) -> Message:
        if req.pinned or req.preload:
            self.models.ensure_loading(req.name, pin=req.pinned)
        if not req.pinned:
            self.models.set_pinned(req.name, False)
        pinned = req.name in self.models.operator_pinned()
        progress = self.models.progress(req.name)
        return ModelFlagsSet(req.name, pinned, progress >= 1.0, progress)

    # ---- unified KV cache ------------------------------------------------

    async def _alloc(self, req: AllocBlocks) -> Message:
        self._require(req.owner, "owner")
        offsets, block_bytes = self.kv.alloc(req.owner, req.shape, req.num_blocks)
        return BlocksAllocated(offsets, block_bytes)

    async def _free(self, req: FreeBlocks) -> Message:
        freed, deferred = self.kv.free(req.owner, req.offsets, req.event)
        return BlocksFreed(freed, deferred)

    async def _reassign(self, req: ReassignBlocks) -> Message:
        self._require(req.new_owner, "new_owner")
        return BlocksReassigned(self.kv.reassign(req.offsets, req.new_owner, req.owner or None))

    # ---- stats ------------------------------------------------------------

    async def _stats(self, req: GetStats) -> Message:
        return self.stats()

    def stats(self) -> CacheStats:
        workers = [
            WorkerInfo(
                lease.worker_id,
                lease.pid,
                list(lease.slots),
                self.kv.num_blocks(lease.worker_id),
                self.models.pinned_by(lease.worker_id),
            )
            for lease in self.workers.leases()
        ]
        return CacheStats(
            self.models.stats(), self.kv.stats(), workers, time.monotonic() - self.started
        )

    def close(self) -> None:
        """Stop the reclaimer and unlink every segment this run made."""
        self.kv.close()
        self.models.close()
        self.events.close()
        self.kv_region.close()
