"""Aegaeon's placement over the store: one node's proxy, or one replica of a stateless
proxy layer over many nodes (``store.kind: redis``). One code path for both.

Any number of replicas run side by side. None owns an instance: the instance
registry and loads, every instance's prefill queue and decode work list, and
the metadata of every request in flight live in the shared store
(``aegaeon_common.registry``); a replica holds only its clients' HTTP streams.
On one node the store is this process's memory (``store.kind: memory``, the
default) and the node's instances, which reach no store, report here: this
backend writes their records for them (``cluster.local_registrar``); everything
else is the same.

* Work carries ``reply_to`` (this replica's report socket): an instance sends
  a request's tokens to the replica that holds its client.
* **A node that dies** stops beating; once its records expire (TTL) every
  replica drops it from dispatch, and each replica ends its own requests there
  (``instance_failed``) or dispatches again those that had no token yet. An
  instance that drains takes no new work; what none can take is held here
  (``held_requests``: an arrival, or a decode placement whose node has no decode
  instance taking work) until one can.
* **A replica that dies** loses its open HTTP streams only: its record
  expires, another replica takes the reap lease, cancels its requests at their
  instances and takes them out of the shared queues.
* **A store that is unreachable** is an answer: new requests get 503 with
  ``Retry-After`` and ``/ready`` fails; requests decoding go on (their tokens
  come straight from the instances). **A store that comes back** (after a
  pause, or restarted empty: a new ``epoch``) is served at once: no record
  missing is taken for a death until the store has answered for a TTL
  (``StoreHealth``), each writer puts its own back within a beat, this replica
  its requests' metadata, and the settings and the served set are written back
  by the replicas that keep them (``cluster.shared_records``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import zmq.asyncio
from aegaeon_common.config import Config
from aegaeon_common.http_side import ServiceAddress
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import CacheStats
from aegaeon_common.messages.prefill import CancelRequest
from aegaeon_common.messages.report import (
    REPORT_CHANNEL,
    InstanceDraining,
    InstanceHello,
    InstanceModels,
    InstanceStalled,
    InstanceStats,
    ModelsResident,
    PrefillDone,
    RequestFailed,
    StepTokens,
)
from aegaeon_common.process import cancel_tasks
from aegaeon_common.registry import (
    INSTANCES,
    PROXIES,
    InstanceRecord,
    ProxyRecord,
    RequestMeta,
    StoreEpoch,
    decode_request,
    encode,
    instance_key,
    open_store,
    proxy_key,
    proxy_requests_key,
    reap_key,
    request_key,
)
from aegaeon_common.store import StoreError
from aegaeon_common.transport import Puller, Pusher, RemoteError, release_security
from aegaeon_common.wire import Message, WireError, to_plain
from aegaeon_sched import percentile
from aegaeon_sched.shared import queue_of, queued_request_ids
from prometheus_client import CollectorRegistry

from aegaeon_proxy.backend import (
    STORE_UNAVAILABLE,
    Backend,
    BackendError,
    EngineSnapshot,
    GenerationRequest,
    TokenQueue,
)
from aegaeon_proxy.cluster.collector import BackendCollector
from aegaeon_proxy.cluster.local_registrar import LocalRegistrar
from aegaeon_proxy.cluster.models import WATCH_S, SharedModels
from aegaeon_proxy.cluster.node_caches import NodeCaches, merge_model_caches, node_services
from aegaeon_proxy.cluster.placement import Baselines, Booking, unqueue
from aegaeon_proxy.cluster.registry import REFRESH_S, RegistryView, StoreHealth
from aegaeon_proxy.cluster.requests import RequestTable, bounds_of
from aegaeon_proxy.cluster.roles import SharedRoles
from aegaeon_proxy.cluster.shared_records import SharedRecords
from aegaeon_proxy.cluster.tracked import Tracked, Where

log = get_logger("cluster")
BEAT_S = 0.5
REAP_S = 1.0
REAP_LEASE_S = 10.0
META_GRACE_S = 60.0  # request metadata outlives the request deadline by this much
DISPATCH_SAMPLES = 4096
STOP_S = 5.0  # a stopping replica's last cancels and store writes
ENGINE_STATS_TIMEOUT_S = 1.0  # the cachemgrs' KV stats for a scrape
STATS_TIMEOUT_S = 5.0  # the cachemgrs' stats for /v1/aegaeon/stats


class ClusterBackend(Backend):
    """A :class:`~aegaeon_proxy.backend.Backend` over the shared store (see the module)."""

    models: SharedModels

    def __init__(self, config: Config) -> None:
        self.config = config
        self.proxy_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.store = open_store(config)
        # a record missing is a death only once the store has answered for a TTL
        self.store_health = StoreHealth(config.store.heartbeat_ttl_s + REFRESH_S)
        self.view = RegistryView(self.store, config.hybrid_prefill, self.store_health)
        self.epoch = StoreEpoch(self.store)
        # the records nobody re-derives (settings, served models): kept by every replica
        self.records = SharedRecords(self.store)
        self.ctx = zmq.asyncio.Context()
        self._reports, self.report_address = _report_socket(config, self.ctx)
        self.table = RequestTable(config, self)  # (this backend is its Placement)
        self.requests: dict[str, Tracked] = self.table.requests  # (the table's own dict)
        self.counters = self.table.counters
        self.held: dict[str, Tracked] = {}  # no instance to dispatch to yet
        # prefilled, no decode instance of its node takes work now (draining, restarting):
        # placed when one does; its handoff stays leased to the prefill instance meanwhile
        self.held_decode: dict[str, tuple[Tracked, Where]] = {}
        self.dispatch_s: deque[float] = deque(maxlen=DISPATCH_SAMPLES)
        self._pushers: dict[str, Pusher] = {}
        self.caches = NodeCaches(self.ctx)
        self._tasks: list[asyncio.Task[None]] = []
        self._jobs: set[asyncio.Task[None]] = set()
        self._store_ok = False
        self._replicas = 1  # replicas beating now (each admits its share of the bounds)
        self._closing = False  # stop() began: every loop ends
        self._checked = False  # the cachemgrs' unreadable models were read once
        # set when an instance joins: its node's cachemgr is asked at once, not at the next
        # poll (a start is ready once it answered)
        self._node_joined = asyncio.Event()
        # set when an instance's record is new in the store: the registry is read again
        # now, not a refresh later (a node's start waits on its instances joining)
        self._new_record = asyncio.Event()
        # one node: the instances report here and this replica writes their records
        self.local = LocalRegistrar(config, self._put_record,
                                    lambda record, msg: self.spawn(self.send(record, msg)))
        self.placement: Booking | Baselines = Baselines(self) if config.unified else Booking(self)
        self.models = SharedModels(config, self.view, self.caches, self.records, self.send,
                                    self.spawn, self.report_address, self.proxy_id)  # fmt: skip
        self.roles = SharedRoles(config, self.store, self.view, self.proxy_id)
        self._handlers: dict[type[Message], Callable[[Any], object]] = {  # (results unread)
            PrefillDone: self._on_prefill_done,
            StepTokens: self.table.step_tokens,
            RequestFailed: self._on_failed,
            InstanceModels: self.models.on_instance_models,  # answers to this replica
            ModelsResident: self.models.on_models_resident,
            # one node's instances (with many, each writes its own record)
            InstanceHello: self.local.on_hello,
            InstanceStats: self.local.on_stats,
            InstanceDraining: self._on_draining,
            InstanceStalled: self.local.on_stalled,
        }

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(t) for t in
                       (self._receive_loop(), self._refresh_loop(), self._beat_loop(),
                        self._reap_loop(), self._unavailable_loop())]  # fmt: skip
        self._tasks += [loop.create_task(self._watch(name)) for name in self.local.expected]
        log.info("replica", proxy_id=self.proxy_id, report_address=self.report_address)

    async def stop(self) -> None:
        """Cancel this replica's requests at their instances, leave the store, close."""
        try:
            await asyncio.wait_for(self._leave(), STOP_S)
        except TimeoutError:
            log.warning("stop_timeout", after_s=STOP_S)
        self._closing = True  # the loops end even if a cancellation is lost in the store
        stuck = await cancel_tasks([*self._tasks, *self._jobs], STOP_S)
        if stuck:
            log.warning("tasks_not_cancelled", tasks=stuck)
        with contextlib.suppress(StoreError, TimeoutError):
            await asyncio.wait_for(self.store.close(), 2.0)
        self.caches.close()
        release_security(self.ctx)  # its ZAP handler (CURVE) first: destroy would wait on it
        self.ctx.destroy(linger=0)  # every socket of this replica, whatever is queued

    async def _leave(self) -> None:
        for request_id in list(self.requests):
            await self.cancel(request_id)
        # one node: nothing more comes from this proxy; an instance stopped after it (a
        # node's stop: the proxy first) drains without waiting for an answer
        # (``AckDrain``'s meaning); a proxy that starts again says so (``ProxyStarted``)
        self.local.leave()
        if self._jobs:
            await asyncio.wait(list(self._jobs), timeout=STOP_S / 2)
        with contextlib.suppress(StoreError):
            await self.store.delete(proxy_key(self.proxy_id), proxy_requests_key(self.proxy_id))
            await self.store.set_remove(PROXIES, self.proxy_id)
            await self.roles.leave()

    def ready(self) -> bool:
        """The store answers and: on one node, every instance is up or restarting and
        the cachemgr's unreadable models are known; with many nodes, some prefill
        instance takes work (a node's unreadable models are not waited for: one whose
        cachemgr is dead would hold every replica; its instance refuses such a request,
        503 ``model_unavailable``, all the same)."""
        if not self._store_ok or self.down():
            return False
        if self.local.expected:
            return self._checked
        return self.placement.takes_work()

    def down(self) -> list[str]:
        """The instances that report here and are neither up nor restarting."""
        now = time.monotonic()
        return [n for n in self.local.expected
                if n not in self.view.live and not self.local.up(n, now)]  # fmt: skip

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(BackendCollector(self.table, self.roles, self.store, self.down,
                                           lambda: (len(self.held), len(self.held_decode))))
        self.table.steps.register(registry)

    async def engine_snapshot(self) -> EngineSnapshot:
        """Device KV of every node's instances in the decode role (their registry
        records) and the nodes' unified CPU KV caches (their cachemgrs' stats, summed;
        unknown if one does not answer)."""
        decoding = [r.load for r in self.view.live.values() if self.view.role(r) == "decode"]
        caches = await self.caches.stats(self.view.live.values(), ENGINE_STATS_TIMEOUT_S)
        kvs = [c.kv for c in caches.values() if c is not None]
        whole = bool(caches) and len(kvs) == len(caches)  # (else the host's is unknown)
        return EngineSnapshot(sum(x.kv_used_bytes for x in decoding),
                              sum(x.kv_capacity_bytes for x in decoding),
                              sum(k.used_bytes for k in kvs) if whole else None,
                              sum(k.capacity_bytes for k in kvs) if whole else None)  # fmt: skip

    def context_limit(self, model: str) -> int | None:
        limits = [r.capacity_tokens[model] for r in self.view.live.values()
                  if model in r.capacity_tokens]  # fmt: skip
        return min(limits) if limits else None

    async def _unavailable_loop(self) -> None:
        """Every :data:`WATCH_S` and whenever an instance joins, the cachemgrs' unreadable
        models, shared; a failed poll is tried again at the next turn (a cachemgr or the
        store may be restarting)."""
        while not self._closing:
            self._node_joined.clear()
            try:
                await self.models.check_unavailable(time.time())
                self._checked = True
            except (BackendError, RemoteError, StoreError, TimeoutError) as exc:
                log.debug("unavailable_models_poll_failed", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._node_joined.wait(), WATCH_S)

    def services(self) -> list[ServiceAddress] | None:
        """Every node's services as its instances registered them; one node's are those
        of the run directory (None), up or not (a restarting one's successor writes
        its address there again)."""
        return None if self.local.expected else node_services(self.view.live.values())

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._jobs.add(task)
        task.add_done_callback(self._job_done)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._jobs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["report_errors"] += 1
            log.error("job_failed", error=repr(task.exception()))

    # ---- requests ------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> TokenQueue:
        if not self._store_ok:
            raise BackendError.store_failed("unreachable")
        if not self.ready():
            down = self.down()
            if down or self.local.expected:
                what = ", ".join(down) or "starting"
                raise BackendError.unavailable(f"instances unavailable: {what}")
            raise BackendError.unavailable("no prefill instance is registered")
        return self.table.open(req).queue

    # ---- placement (the request table's Placement) ----------------------------
    def place(self, tracked: Tracked) -> None:
        self.roles.arrived(time.monotonic(), tracked.sched.prompt_len)
        self.spawn(self._arrive(tracked))

    def replace(self, tracked: Tracked) -> None:
        self.spawn(self.placement.dispatch(tracked, again=True))

    def unplace(self, tracked: Tracked, cancelled: bool) -> None:
        rid = tracked.gen.request_id
        self.held.pop(rid, None)
        where, tracked.where = tracked.where, None
        self.placement.release(tracked, where, cancelled)
        self.spawn(self._forget(rid))

    def cancel_orphan(self, request_id: str, msg: StepTokens) -> None:
        """At every node's decode-i (a report names only the index; a cancel of an
        unknown id is a no-op)."""
        self._cancel_at(request_id, None, msg.index, free_handoff=False)

    def _cancel_at(self, request_id: str, kind: str | None, index: int, free_handoff: bool,
                   node: str | None = None) -> None:  # fmt: skip
        """At every live instance of that index, kind and node (None: any)."""
        cancel = CancelRequest(request_id, free_handoff=free_handoff)
        for r in list(self.view.live.values()):
            if r.index == index and kind in (None, r.kind) and node in (None, r.node):
                self.spawn(self.send(r, cancel))

    async def _arrive(self, tracked: Tracked) -> None:
        rid = tracked.gen.request_id
        try:
            await self.store.set_add(proxy_requests_key(self.proxy_id), rid)
            await self.put_meta(tracked)
        except StoreError as exc:
            self.store_failed(rid, exc)
            return
        await self.placement.dispatch(tracked)

    async def cancel(self, request_id: str) -> None:
        self.table.end(request_id, "cancelled", cancelled=True)

    async def _forget(self, request_id: str) -> None:
        with contextlib.suppress(StoreError):
            await self.store.delete(request_key(request_id))
            await self.store.set_remove(proxy_requests_key(self.proxy_id), request_id)

    def _store_trouble(self, event: str, exc: StoreError, **fields: object) -> None:
        """The store failed an operation: no record missing is a death for a TTL."""
        self.store_health.troubled()
        self.counters["store_errors"] += 1
        log.warning(event, error=str(exc), **fields)

    def store_failed(self, request_id: str, exc: StoreError) -> None:
        self._store_trouble("store_error", exc, request_id=request_id)
        self.table.end(request_id, "error", f"the shared store failed: {exc}",
                       code=STORE_UNAVAILABLE)  # fmt: skip

    async def put_meta(self, tracked: Tracked) -> None:
        """Its metadata: where it is, "decoding" there or "queued" (for a prefill, or
        for none yet)."""
        gen, where = tracked.gen, tracked.where
        state = "decoding" if where is not None and where.stage != "prefill" else "queued"
        meta = RequestMeta(
            v=1, request_id=gen.request_id, model=gen.model, proxy=self.proxy_id,
            instance=where.instance if where else "", state=state,
            tokens_sent=tracked.num_generated, arrival_s=gen.arrival_s,
            queue=where.queue if where else "",
        )  # fmt: skip
        ttl_s = self.config.proxy.request_timeout_s + META_GRACE_S
        await self.store.put(request_key(gen.request_id), encode(meta), ttl_s)
        tracked.tokens_written = meta.tokens_sent

    async def send_to(self, where: Where, msg: Message) -> None:
        """To the process ``where`` names, if it still runs."""
        record = self.view.live.get(where.instance)
        if record is not None and record.incarnation == where.incarnation:
            await self.send(record, msg)

    async def send(self, record: InstanceRecord, msg: Message) -> None:
        pusher = self._pushers.get(record.instance_id)
        if pusher is None or pusher.address != record.address:
            if pusher is not None:
                pusher.close()
            pusher = self._pushers[record.instance_id] = Pusher(self.ctx, record.address)
        await pusher.send(msg)

    # ---- reports -------------------------------------------------------------
    async def _receive_loop(self) -> None:
        """Each report's handler, forever: a bug handling one must not stop every later
        one (heartbeats included: the instances would all look dead)."""
        while True:
            try:
                msg = await self._reports.recv()
            except WireError as exc:
                self.counters["bad_frames"] += 1
                log.warning("bad report frame", error=str(exc))
                continue
            try:
                if isinstance(msg, PrefillDone | StepTokens | RequestFailed):
                    # before the request ends: once its client has the answer, the stats
                    # no longer count it on the instance that ended it
                    self.local.note_holdings(msg.kind, msg.index, msg.holdings)
                self._handlers[type(msg)](msg)
            except Exception:
                self.counters["report_errors"] += 1
                log.exception("report_failed", tag=msg.TAG)

    def _on_prefill_done(self, msg: PrefillDone) -> None:
        known = self.requests.get(msg.request_id)
        where = known.where if known is not None else None
        owner = f"{msg.kind}-{msg.index}"  # (its node's cachemgr knows it by this name)
        tracked = self.table.prefilled(msg, owner) if where is not None else None
        if tracked is None or where is None:
            self.counters["orphan_tokens"] += 1
            if msg.request_id not in self.requests and msg.handoff is not None:
                # cancelled meanwhile, or a request of a replica that died: nobody will
                # claim this KV. A report names only the kind and index, not the node:
                # the cancel goes to that instance of every node (a no-op where unknown)
                self._cancel_at(msg.request_id, msg.kind, msg.index, free_handoff=True)
            return
        self.placement.prefilled(tracked, where, msg)

    def _on_failed(self, msg: RequestFailed) -> None:
        tracked = self.requests.get(msg.request_id)
        where = tracked.where if tracked is not None else None
        name = where.instance if where else f"{msg.kind}-{msg.index}"
        if msg.code == "model_unavailable" and tracked is not None:
            self.models.failed(tracked.gen.model, msg.message)
        self.table.failed(msg.request_id, name, msg.code, msg.message)

    # ---- one node's instances (cluster.local_registrar) ------------------------
    def _put_record(self, record: InstanceRecord, live: bool) -> None:
        """Write (``live``) or delete an instance's record, as its own registrar would;
        dispatch reads the new one at once (a draining one takes no new work); a record
        new in the store wakes the registry's refresh."""
        known = self.view.alive(record.instance_id, record.incarnation)
        if live and known:
            self.view.live[record.instance_id] = record
        ttl_s = self.config.store.heartbeat_ttl_s

        async def write() -> None:
            try:
                if live:
                    await self.store.put(instance_key(record.instance_id), encode(record), ttl_s)
                    await self.store.set_add(INSTANCES, record.instance_id)
                    if not known:
                        self._new_record.set()
                else:
                    await self.store.delete(instance_key(record.instance_id))
            except StoreError as exc:
                self._store_trouble("registry_write_failed", exc, instance=record.instance_id)

        self.spawn(write())

    def _on_draining(self, msg: InstanceDraining) -> None:
        record = self.local.on_draining(msg)
        if record is not None:
            held = sum(1 for t in self.requests.values()
                       if t.where is not None and t.where.instance == record.instance_id)
            log.info("instance_draining", instance=record.instance_id, pid=msg.pid,
                     requests=held)  # fmt: skip

    async def _watch(self, name: str) -> None:
        """One node: an instance whose process ended (its command socket disconnected) is
        down now, not a TTL later; one draining exits on purpose. (A socket of its own
        that sends nothing: the one work goes on closes with the instance's record.)"""
        kind, _, index = name.rpartition("-")
        watcher = Pusher(self.ctx, self.config.instance_address(kind, int(index)))
        try:
            while not self._closing:
                await watcher.disconnected()
                if self.local.ended(name):
                    log.error("instance down", instance=name, why="its process ended")
        finally:
            watcher.close()

    # ---- the registry, nodes joining and leaving -----------------------------
    async def _refresh_loop(self) -> None:
        while not self._closing:
            try:
                if await self.epoch.check():
                    self._store_lost()
                elif not self._store_ok and self.store_health.num_troubles:
                    log.warning("store_back", after="unreachable")
                # the served models before the registry: a model added on another
                # replica is on the records read after it (it published once they were);
                # then the settings (and what this replica writes back of either)
                await self.records.refresh()
                joined, left = await self.view.refresh()
                await self.roles.refresh()
                self._store_ok = True
            except StoreError as exc:
                self.store_health.troubled()
                if self._store_ok:
                    log.error("store_unreachable", error=str(exc))
                self._store_ok = False
                await asyncio.sleep(REFRESH_S)
                continue
            for record in joined:
                log.info("instance_joined", instance=record.instance_id, node=record.node,
                         address=record.address)  # fmt: skip
                self.models.on_joined(record)
                self._node_joined.set()
            for record in left:
                self._instance_left(record)
            self.models.changed()  # waits on the instances look again
            for tracked in list(self.requests.values()):
                where = tracked.where
                if where is not None and not self.view.alive(where.instance, where.incarnation):
                    self.lost(tracked, where)
            if self.held and self.placement.takes_work():
                for tracked in list(self.held.values()):
                    self.spawn(self.placement.dispatch(tracked))
            self.placement.refresh(time.monotonic())
            try:  # (room is freed by events; this is a safety net, which must not die)
                self._admission_bounds()
                self.table.release_deferred()
                self.table.expire_deferred(time.time())
            except Exception:
                log.exception("deferred_requests_check_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_record.wait(), REFRESH_S)
            self._new_record.clear()

    def _store_lost(self) -> None:
        """The store restarted empty (a new epoch): this replica's own records come back
        with its next beat, its requests' metadata now."""
        self.store_health.troubled()
        self.counters["store_losses"] += 1
        log.warning("store_lost", requests=len(self.requests),
                    action="rebuilding this replica's records")  # fmt: skip
        self.roles.store_lost()

        async def rewrite() -> None:
            for rid, tracked in list(self.requests.items()):
                with contextlib.suppress(StoreError):
                    await self.store.set_add(proxy_requests_key(self.proxy_id), rid)
                    await self.put_meta(tracked)

        self.spawn(rewrite())

    def _admission_bounds(self) -> None:
        live = list(self.view.live.values())
        if not any(r.latency is not None for r in live):
            return  # (nothing to derive them from yet: admitted unbounded meanwhile)
        bounds = bounds_of(self.config, live, self._replicas)
        admission = self.table.admission
        if admission is None or admission.bounds != bounds:
            log.info("admission_bounds", bounds=bounds, replicas=self._replicas)
            self.table.set_bounds(bounds)

    def _instance_left(self, record: InstanceRecord) -> None:
        self.counters["instances_lost"] += 1
        log.warning("instance_left", instance=record.instance_id, node=record.node,
                    why="its heartbeat expired or it restarted")  # fmt: skip
        current = self.view.live.get(record.instance_id)
        pusher = self._pushers.get(record.instance_id)
        if pusher is not None and (current is None or current.address != pusher.address):
            pusher.close()  # (a successor at the same address keeps it)
            del self._pushers[record.instance_id]
        stale = [RegistryView.queue_key(record, stage) for stage in ("prefill", "decode")]

        async def drop() -> None:
            with contextlib.suppress(StoreError):
                await self.store.delete(*stale)

        self.spawn(drop())

    def lost(self, tracked: Tracked, where: Where) -> None:
        """``tracked``'s instance is gone: dispatch it again when no token was sent, else
        end it with ``instance_failed``."""
        rid, owner = tracked.gen.request_id, tracked.handoff_owner
        tracked.where = None
        if owner and where.stage == "decode":  # its handoff, if not claimed (one node's)
            kind, _, index = owner.rpartition("-")
            self._cancel_at(rid, kind, int(index), free_handoff=True, node=where.node)
        self.table.lost(tracked, where.instance, f"instance {where.instance} is gone (its "
                        "heartbeat expired)")  # fmt: skip

    # ---- this replica's heartbeat and the reaper -----------------------------
    async def _beat_loop(self) -> None:
        ttl_s = self.config.store.heartbeat_ttl_s
        while not self._closing:
            record = ProxyRecord(
                v=1, proxy_id=self.proxy_id, report_address=self.report_address,
                pid=os.getpid(), host=socket.gethostname(),
                arrival_tokens_per_s=self.roles.arrivals.rate(time.monotonic()),
            )  # fmt: skip
            try:
                await self.store.put(proxy_key(self.proxy_id), encode(record), ttl_s)
                await self.store.set_add(PROXIES, self.proxy_id)
                for tracked in list(self.requests.values()):  # (tokens sent since, placed)
                    if tracked.where and tracked.num_generated != tracked.tokens_written:
                        await self.put_meta(tracked)
            except StoreError as exc:
                self._store_trouble("beat_failed", exc)
            await asyncio.sleep(BEAT_S)

    async def _reap_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(REAP_S)
            try:
                ids = sorted(await self.store.set_members(PROXIES))
                raws = await self.store.get_many([proxy_key(p) for p in ids])
                self._replicas = max(1, sum(1 for raw in raws if raw is not None))
                if not self.store_health.settled():
                    continue  # (a replica's record missing now may be the store's doing)
                for proxy_id, raw in zip(ids, raws, strict=True):
                    if raw is not None or proxy_id == self.proxy_id:
                        continue
                    if await self.store.put_if_absent(reap_key(proxy_id),
                                                      self.proxy_id.encode(), REAP_LEASE_S):
                        await self._reap(proxy_id)
            except StoreError as exc:
                self._store_trouble("reap_failed", exc)

    async def _reap(self, proxy_id: str) -> None:
        """A dead replica's requests: cancelled at their instances, out of the queues.

        Its request metadata names where each request was last written to be; a
        replica killed between a queue transaction and that write (a first token
        sent, the placement committed, the metadata not rewritten yet) leaves the
        request in a queue the metadata does not name. So every live instance's
        queues are searched for the dead replica's ids as well."""
        rids = sorted(await self.store.set_members(proxy_requests_key(proxy_id)))
        owned = set(rids)
        # request id -> instance that may hold it -> whether to free its handoff there
        # (an instance that prefilled it, not one that decodes it)
        cancel_at: dict[str, dict[str, bool]] = {}
        queued: dict[str, set[str]] = {}  # queue key -> the dead replica's ids in it
        for rid, raw in zip(rids, await self.store.get_many([request_key(r) for r in rids]),
                            strict=True):  # fmt: skip
            try:
                meta = decode_request(raw) if raw is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                meta = None
            if meta is not None and meta.instance:
                cancel_at.setdefault(rid, {})[meta.instance] = meta.state != "decoding"
            if meta is not None and meta.queue:
                queued.setdefault(meta.queue, set()).add(rid)
        if owned:
            places = [(r.instance_id, RegistryView.queue_key(r, stage), stage == "prefill")
                      for r in self.view.live.values() for stage in ("prefill", "decode")]
            states = await self.store.get_many([key for _, key, _ in places])
            for (instance, key, prefill), raw in zip(places, states, strict=True):
                for rid in queued_request_ids(queue_of(raw, prefill)) & owned:
                    at = cancel_at.setdefault(rid, {})
                    at[instance] = at.get(instance, False) or prefill
                    queued.setdefault(key, set()).add(rid)
        for rid, instances in sorted(cancel_at.items()):
            for instance, free in sorted(instances.items()):
                record = self.view.live.get(instance)
                if record is not None:  # (a handoff its replica never placed is freed)
                    await self.send(record, CancelRequest(rid, free_handoff=free))
        for queue, ids in sorted(queued.items()):
            for rid in sorted(ids):
                await unqueue(self.store, self.config, rid, queue)
        await self.store.delete(*(request_key(r) for r in rids), proxy_requests_key(proxy_id))
        await self.store.set_remove(PROXIES, proxy_id)
        self.counters["reaped"] += len(rids)
        log.warning("proxy_reaped", proxy=proxy_id, requests=len(rids),
                    queues=len(queued))  # fmt: skip

    # ---- observability ---------------------------------------------------------
    def health(self) -> dict[str, object]:
        instances: dict[str, object] = {
            r.instance_id: {"alive": True, "pid": r.pid, "node": r.node,
                            "draining": r.draining, "active_model": r.load.active_model,
                            "role": self.view.role(r)}
            for r in self.view.live.values()
        }  # fmt: skip
        now = time.monotonic()
        for name in self.local.expected:  # (one node: every instance it runs, up or not)
            if name not in instances:
                restarting = self.local.restarting(name, now)  # (after a drain)
                pid = self.local.instances[name].record.pid if restarting else None
                instances[name] = {"alive": restarting, "pid": pid, "active_model": None}
        return {
            "policy": self.config.scheduler.policy,
            "proxy_id": self.proxy_id,
            "ready": self.ready(),
            "store": "up" if self._store_ok else "unreachable",
            "requests": len(self.requests),
            "instances": instances,
        }

    def _instances(self, caches: dict[str, CacheStats | None]) -> list[dict[str, object]]:
        """What each instance holds now (``leases``: -1 where its node's cachemgr did not
        answer); all 0 on an idle deployment that leaked nothing."""
        local = self.local.instances
        out: list[dict[str, object]] = []
        for r in self.view.live.values():
            cache = caches.get(r.node)
            kept = local[r.instance_id].holdings if r.instance_id in local else None
            holding = kept or r.load  # (one node: a report about a request may be newer)
            owner = f"{r.kind}-{r.index}"  # (its node's cachemgr knows it by this name)
            out.append({
                "name": r.instance_id, "kind": r.kind, "index": r.index, "node": r.node,
                "pid": r.pid, "alive": True, "draining": r.draining,
                "kv_blocks_in_use": holding.kv_blocks_in_use,
                "leases": int(cache.kv.blocks_per_owner.get(owner, 0)) if cache else -1,
                "open_sequences": holding.open_sequences, "role": self.view.role(r),
            })  # fmt: skip
        return out

    async def stats(self, light: bool = False) -> dict[str, object]:
        """Everything the benchmarks read: instance holdings and heartbeats, switches,
        turns, request timings, the cachemgrs' stats (one node: its own; many: by node);
        ``light`` leaves the record lists out (for frequent polls)."""
        samples = list(self.dispatch_s)
        caches = await self.caches.stats(self.view.live.values(), STATS_TIMEOUT_S)
        plain = {n: to_plain(c) if c is not None else None for n, c in caches.items()}
        cache = next(iter(plain.values())) if len(plain) == 1 else None
        if len(plain) > 1:  # each node's, and the Model Caches merged as `GET` shows them
            models = {n: c["model_cache"] for n, c in plain.items() if c is not None}
            cache = {"model_cache": merge_model_caches(models) if models else None,
                     "nodes": plain}  # fmt: skip
        out: dict[str, object] = {
            "policy": self.config.scheduler.policy,
            "proxy_id": self.proxy_id,
            "counters": dict(self.counters),
            "open_requests": len(self.requests),
            "held_requests": len(self.held) + len(self.held_decode),
            "instances": self._instances(caches),
            # each instance's last heartbeat by name (one node's: with many nodes the
            # records' loads are in `instances`)
            "instance_stats": {
                name: to_plain(local.stats) if local.stats is not None else None
                for name, local in self.local.instances.items()
            },
            "cache": cache,
            "nodes": sorted({r.node for r in self.view.live.values()}),
            "store": {"kind": self.config.store.kind, "commits": self.store.num_commits,
                      "conflicts": self.store.num_conflicts},
            "dispatch_s": {"count": len(samples),
                           "p50": percentile(samples, 50) if samples else None,
                           "p99": percentile(samples, 99) if samples else None},
            "admission": self.table.admission.snapshot() if self.table.admission else None,
            "slo_classes": self.table.classes_snapshot(),
            "roles": self.roles.snapshot(time.monotonic()),
        }
        if light:
            return out
        # Each instance's start-up latency profile (aegaeon_sched.LatencyModel
        # dicts): what a simulation of this deployment should use.
        out["latency"] = {r.instance_id: to_plain(r.latency) for r in self.view.live.values()
                          if r.latency is not None}  # fmt: skip
        sched = self.config.scheduler  # what a simulation needs besides the profiles
        out["layout"] = {
            "policy": sched.policy, "unified": self.config.unified,
            "hybrid_prefill": self.config.hybrid_prefill,
            "prefill": self.config.prefill.instances, "decode": self.config.decode.instances,
            "q_max_s": sched.q_max_s, "max_group_size": sched.max_group_size,
            "max_batch_size": sched.max_batch_size,
        }  # fmt: skip
        out["timings"] = list(self.table.timings)
        out["switches"] = [{"instance": n, **to_plain(r)} for n, r in self.local.switches]
        out["turns"] = [{"instance": n, **to_plain(r)} for n, r in self.local.turns]
        return out


def _report_socket(config: Config, ctx: zmq.asyncio.Context) -> tuple[Puller, str]:
    """Where the instances send this replica's reports, and the address they are told.
    One node: the proxy's address (``ipc://`` in the run directory, or as configured);
    many: ``node.proxy_report_port`` on tcp (0: an ephemeral port)."""
    if not config.distributed:
        return Puller(ctx, config.proxy_address, REPORT_CHANNEL, bind=True), config.proxy_address
    node = config.node
    bind_host = node.bind_address or node.advertise_address or "127.0.0.1"
    reports = Puller(ctx, f"tcp://{bind_host}:{node.proxy_report_port}", REPORT_CHANNEL,
                     bind=True)  # fmt: skip
    port = reports.bound_address.rpartition(":")[2]
    return reports, f"tcp://{node.advertise_address or '127.0.0.1'}:{port}"

