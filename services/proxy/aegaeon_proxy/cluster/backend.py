"""The distributed backend: the global scheduler driving instances over ZeroMQ.

The proxy owns the configured policy (``libs/sched``: Aegaeon's Algorithms 1-2,
or a request-level baseline) and carries out its actions as messages to the
instances; instances report first tokens with their KV handoffs, step tokens,
failures and heartbeats on one PULL socket. Everything here runs on the
proxy's event loop; nothing blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any

import zmq.asyncio
from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import (
    REPLIES,
    CacheStats,
    FreeBlocks,
    GetStats,
)
from aegaeon_common.messages.prefill import AckDrain, CancelRequest, ProxyStarted
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
from aegaeon_common.messages.structs import Holdings
from aegaeon_common.process import cancel_tasks
from aegaeon_common.transport import Puller, RemoteError, RpcClient, release_security
from aegaeon_common.wire import Message, to_plain
from aegaeon_sched import Policy, Shedder, cluster_velocity
from aegaeon_sched.admission import AdmissionControl
from prometheus_client import CollectorRegistry

from aegaeon_proxy.backend import (
    Backend,
    BackendError,
    EngineSnapshot,
    GenerationRequest,
    TokenQueue,
)
from aegaeon_proxy.cluster.actions import ActionRunner
from aegaeon_proxy.cluster.collector import ClusterCollector
from aegaeon_proxy.cluster.instances import DecodeShares, Instances, InstanceView
from aegaeon_proxy.cluster.models import ClusterModels
from aegaeon_proxy.cluster.policy import admission_bounds, build_policy
from aegaeon_proxy.cluster.quarantine import (
    POLL_TIMEOUT_S,
    Quarantine,
    unavailable_of,
    watch_caches,
)
from aegaeon_proxy.cluster.reports import receive_reports
from aegaeon_proxy.cluster.requests import RequestTable
from aegaeon_proxy.cluster.roles import RoleSwitcher, base_role, view_meter
from aegaeon_proxy.cluster.tracked import Tracked

log = get_logger("cluster")
MONITOR_S = 0.5
ENGINE_STATS_TIMEOUT_S = 1.0  # the cachemgr's KV stats for a scrape
INCARNATION = secrets.randbits(62) + 1  # this proxy process, in the instances' eyes


class ClusterBackend(Backend):
    """A :class:`~aegaeon_proxy.backend.Backend` over prefill/decode instances."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.unified = config.unified
        self.ctx = zmq.asyncio.Context()
        self.instances = Instances.connect(config, self.ctx, self.unified)
        self.policy: Policy | None = None
        # requests, their admission by SLO class (the bounds come with the policy),
        # streams, ends and retries; placement (the policy) is this backend's
        self.table = RequestTable(config, self)
        self.requests: dict[str, Tracked] = self.table.requests  # (the table's own dict)
        # token velocity and, with roles.enabled, prefill/decode role switching
        if config.roles.enabled and not config.role_switching:
            log.warning("roles.enabled needs the aegaeon policy with "
                        "scheduler.prefill_decodes_when_idle: roles stay fixed")  # fmt: skip
        self.roles = RoleSwitcher(config, {v.name: base_role(v.kind) for v in self.instances},
                                  config.role_switching)  # fmt: skip
        self._reports = Puller(self.ctx, config.proxy_address, REPORT_CHANNEL, bind=True)
        self._cache = RpcClient(self.ctx, config.cachemgr_address, REPLIES)
        self._tasks: list[asyncio.Task[None]] = []
        self._actions = ActionRunner(self)
        self._shares = DecodeShares()
        # models added and removed at run time
        self.models = ClusterModels(config, self.instances, self._cache, self._actions.send,
                                    lambda: self.policy)  # fmt: skip
        # models whose checkpoint cannot be read (the cachemgr's, the instances' reports)
        self.quarantine = Quarantine()
        self._checked = False  # the cachemgr's unreadable models were read once
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            InstanceHello: self._on_hello,
            InstanceStats: self._on_stats,
            PrefillDone: self._on_prefill_done,
            StepTokens: self._on_step_tokens,
            RequestFailed: self._on_failed,
            InstanceDraining: self._on_draining,
            InstanceStalled: self._on_stalled,
            InstanceModels: self.models.on_instance_models,
            ModelsResident: self.models.on_models_resident,
        }

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._monitor()),
                       loop.create_task(watch_caches(self._poll_unavailable,
                                                     self._found_unavailable, lambda: False))]
        self._tasks += [loop.create_task(self._watch(view)) for view in self.instances]

    async def stop(self) -> None:
        self.table.cancel_all()
        # nothing more comes from this proxy: an instance stopped after it (a node's
        # stop: the proxy first) drains without waiting for an answer (``AckDrain``'s
        # meaning); a proxy that starts again says so first (``ProxyStarted``)
        for view in self.instances:
            if view.pid is not None:
                self._actions.send(view.name, AckDrain(view.pid))
        stuck = await cancel_tasks(self._tasks)
        if stuck:
            log.warning("tasks_not_cancelled", tasks=stuck)
        await self._actions.flush()
        self._reports.close()
        self._cache.close()
        self.instances.close()
        release_security(self.ctx)
        self.ctx.term()

    def ready(self) -> bool:
        """Every instance is up, or restarting after a drain (its work waits here), and
        the cachemgr was asked which models it cannot read."""
        return self.policy is not None and self.instances.all_alive() and self._checked

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(ClusterCollector(self))
        self.table.steps.register(registry)

    async def engine_snapshot(self) -> EngineSnapshot:
        """Device KV of the instances in the decode role (their last heartbeats) and
        the unified CPU KV cache (the cachemgr's stats; unknown if it does not answer)."""
        decoding = [v.stats.counters for v in self.instances
                    if v.stats is not None and self.roles.role(v.name) == "decode"]  # fmt: skip
        used = int(sum(c.get("kv_used_bytes", 0.0) for c in decoding))
        capacity = int(sum(c.get("kv_capacity_bytes", 0.0) for c in decoding))
        host_used = host_capacity = None
        with contextlib.suppress(RemoteError, TimeoutError):
            reply = await self._cache.call(GetStats(), timeout_s=ENGINE_STATS_TIMEOUT_S)
            if isinstance(reply, CacheStats):
                host_used, host_capacity = reply.kv.used_bytes, reply.kv.capacity_bytes
        return EngineSnapshot(used, capacity, host_used, host_capacity)

    def held_counts(self) -> tuple[int, int]:
        """Requests the policy holds: (waiting for a prefill instance, for a decode one)."""
        return self.policy.held_counts() if self.policy is not None else (0, 0)

    def context_limit(self, model: str) -> int | None:
        """Tokens of KV one request may hold on every instance (prompt + output)."""
        limits = [
            v.hello.capacity_tokens[model]
            for v in self.instances
            if v.hello is not None and model in v.hello.capacity_tokens
        ]
        return min(limits) if limits else None

    # ---- models at run time (ModelControl; cluster.models) --------------------
    async def add_model(self, model: ModelConfig) -> None:
        await self.models.add(model)

    async def forget_model(self, name: str) -> bool:
        return await self.models.forget(name)

    async def set_model_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        await self.models.set_flags(name, pinned=pinned, preload=preload)

    async def model_cache(self) -> dict[str, Any] | None:
        return await self.models.cache_stats()

    # ---- checkpoints that cannot be read (ModelQuarantine; cluster.quarantine) -----
    def follow_unavailable(self, apply: Callable[[str, str | None], None]) -> None:
        self.quarantine.follow(apply)

    async def quarantine_model(self, name: str, why: str | None) -> None:
        if why is None:
            self.quarantine.lift(name, time.time())
        else:
            self.quarantine.set(name, why)

    async def reload_model(self, model: ModelConfig) -> None:
        began = time.time()
        try:
            await self.models.reload(model)
        except BackendError as exc:
            if exc.code == "model_unavailable":  # unavailable still: for what is wrong now
                self.quarantine.lift(model.name, began)
                self.quarantine.set(model.name, exc.message)
            raise
        self.quarantine.lift(model.name, began)

    async def _poll_unavailable(self) -> dict[str, str]:
        return unavailable_of([await self._cache.call(GetStats(), timeout_s=POLL_TIMEOUT_S)])

    async def _found_unavailable(self, models: dict[str, str], asked_at: float) -> None:
        for name, why in models.items():
            self.quarantine.set(name, why, asked_at)
        self._checked = True  # (ready: the cachemgr's unreadable models are known here)

    # ---- sleep and wake (ModelResidency; cluster.models) -------------------------
    async def set_model_awake(self, name: str, awake: bool) -> bool:
        return await self.models.set_awake(name, awake)

    def model_sleeping(self, name: str) -> bool:
        return self.models.sleeping(name)

    # ---- requests (the table; placement is the policy's) ----------------------
    @property
    def counters(self) -> dict[str, int]:
        return self.table.counters

    @property
    def shedder(self) -> Shedder | None:
        return self.table.shedder

    @property
    def admission(self) -> AdmissionControl | None:
        return self.table.admission

    def submit(self, req: GenerationRequest) -> TokenQueue:
        if not self.ready() or self.policy is None:
            down = [v.name for v in self.instances if not v.alive(time.monotonic())]
            what = ", ".join(down) or "starting"
            raise BackendError.unavailable(f"instances unavailable: {what}")
        tracked = self.table.open(req)
        self.roles.arrived(time.monotonic(), tracked.sched.prompt_len)
        return tracked.queue

    def place(self, tracked: Tracked) -> None:
        """(Placement) The policy takes it."""
        assert self.policy is not None
        self._actions.run(self.policy.on_arrival(tracked.sched, time.time()))

    def replace(self, tracked: Tracked) -> None:
        """(Placement) Its instance is paused: the policy places it elsewhere or holds it
        for the instance's successor."""
        assert self.policy is not None
        now = time.time()
        self._actions.run(self.policy.on_request_cancelled(tracked.gen.request_id, now))
        self._actions.run(self.policy.on_arrival(tracked.sched, now))

    def unplace(self, tracked: Tracked, cancelled: bool) -> None:
        """(Placement) The policy lets it go (the cancel reaches its instance)."""
        if self.policy is None:
            return
        rid, now = tracked.gen.request_id, time.time()
        ended = self.policy.on_request_cancelled if cancelled else self.policy.on_request_finished
        self._actions.run(ended(rid, now))

    def cancel_orphan(self, request_id: str, msg: StepTokens) -> None:
        """(Placement) At prefill-i and decode-i: a report names only the index; a
        cancel of an unknown id is a no-op."""
        for kind in ("prefill", "decode"):
            if self.instances.get(kind, msg.index) is not None:
                self._actions.send(f"{kind}-{msg.index}", CancelRequest(request_id))

    async def cancel(self, request_id: str) -> None:
        if self.policy is not None:
            self.table.cancel(request_id)

    def end_request(
        self, request_id: str, reason: str, error: str | None = None, code: str | None = None
    ) -> Tracked | None:
        """The request is over (finished or failed): tell the policy, close the stream."""
        return self.table.end(request_id, reason, error, code)

    # ---- reports -------------------------------------------------------------
    async def _receive(self) -> None:
        await receive_reports(self._reports, self._handlers, self.counters)

    def _on_hello(self, msg: InstanceHello) -> None:
        known = self.instances.get(msg.kind, msg.index)
        first = known is not None and known.hello is None  # first hello this process got
        view, restarted = self.instances.on_hello(msg)
        if view is None:
            log.warning("hello from an unknown instance", kind=msg.kind, index=msg.index)
            return
        if first:
            # Before any work of ours (no work goes to an instance before its hello; one
            # ordered queue): what it holds is an earlier proxy's, whose clients are
            # gone; it drops that and frees the KV handoffs nobody claimed. (Proxy
            # replicas share instances: cluster.distributed never sends this.)
            self._actions.send(view.name, ProxyStarted(INCARNATION))
        if restarted:
            log.info("instance_restarted", instance=view.name, pid=msg.pid)
            self._fail_instance(view.name, f"instance {view.name} restarted")
        if self.policy is None and all(v.hello is not None for v in self.instances):
            self.policy = build_policy(self.config, self.instances, self.unified)
            bounds = admission_bounds(self.config, self.instances)
            self.table.set_bounds(bounds)
            log.info("policy ready", policy=self.policy.name, admission=bounds)
            for other in self.instances:  # drained or died before the policy existed
                if other.paused:
                    self._actions.run(self.policy.pause(other.name))
        if view.paused and not view.draining:  # back from a drain or from the dead
            view.paused = False
            if self.policy is not None:
                self._actions.run(self.policy.resume(view.name, time.time()))
            log.info("instance_rejoined", instance=view.name, pid=msg.pid)
        self.models.on_hello(view, msg)

    def _on_draining(self, msg: InstanceDraining) -> None:
        """Send the instance no new work; the ack follows everything sent to it so far."""
        view = self.instances.on_draining(msg.kind, msg.index, msg.pid, msg.timeout_s)
        if view is None:
            return
        if self.policy is not None:
            self._actions.run(self.policy.pause(view.name))
        held = sum(1 for t in self.requests.values() if t.instance == view.name)
        log.info("instance_draining", instance=view.name, pid=msg.pid, requests=held)
        self._actions.send(view.name, AckDrain(msg.pid))

    def _on_stalled(self, msg: InstanceStalled) -> None:
        """Its compute thread made no progress with work to do: down now (not a heartbeat
        timeout later, its event loop still beats), its requests failed over; its
        process says no hello again (``aegaeon_runtime.liveness``)."""
        view = self.instances.get(msg.kind, msg.index)
        if view is None or view.pid != msg.pid:
            return
        self.instances.mark_dead(view)
        self._instance_down(view.name, f"its compute thread stalled: {msg.reason}")

    def _on_stats(self, msg: InstanceStats) -> None:
        view = self.instances.on_stats(msg)
        if view is None:
            return
        # a prefill instance decodes when idle; with roles moving, a decode one prefills
        prefills = msg.kind == "prefill" or self.config.role_switching
        if self.config.hybrid_prefill and prefills:
            share = self._shares.observe(view.name, msg.counters.get("prefill_s", 0.0))
            if self.policy is not None:
                self.policy.set_decode_share(view.name, share)
        now = time.monotonic()
        self.roles.heartbeat(view_meter(view), now)
        load = self.policy.role_load() if self.policy is not None else None
        if self.policy is not None and load is not None:
            views = list(self.instances)
            steady = all(v.alive(now) and not v.paused for v in views)
            for change in self.roles.observe(now, load, views, steady):
                self._actions.run(self.policy.set_role(change.instance, change.role, time.time()))

    def _on_prefill_done(self, msg: PrefillDone) -> None:
        self.instances.note_holdings(msg.kind, msg.index, msg.holdings)
        # (a decode instance prefills too when roles move: the blocks are its own)
        owner = f"{msg.kind}-{msg.index}"
        tracked = self.table.prefilled(msg, owner)
        if tracked is None:
            # cancelled meanwhile, or a second prefill of it (work queued for an
            # instance that died reached its successor): nobody will claim this KV
            if msg.handoff is not None:
                self._free_orphan(owner, msg.handoff.block_offsets)
            return
        if self.table.finish_first(tracked, msg):
            return
        assert self.policy is not None
        instance = tracked.instance or ""
        measured = msg.timings.extra.get("prefill_compute_s", msg.timings.prefill_s)
        self._actions.run(
            self.policy.on_prefill_done(instance, msg.request_id, measured, time.time())
        )

    def _on_step_tokens(self, msg: StepTokens) -> None:
        # before the request ends: once its client has the answer, the stats no
        # longer count it on the instance that ended it
        self.instances.note_holdings(msg.kind, msg.index, msg.holdings)
        self.table.step_tokens(msg)

    def _on_failed(self, msg: RequestFailed) -> None:
        self.instances.note_holdings(msg.kind, msg.index, msg.holdings)
        tracked = self.requests.get(msg.request_id)
        if msg.code == "model_unavailable" and tracked is not None:
            self.quarantine.set(tracked.gen.model, msg.message)
        self.table.failed(msg.request_id, f"{msg.kind}-{msg.index}", msg.code, msg.message)

    # ---- failures --------------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            for view in self.instances.newly_dead():
                self._instance_down(view.name, "its heartbeat stopped")
            try:  # (room is freed by events; this is a safety net, which must not die)
                self.table.release_deferred()
                self.table.expire_deferred(time.time())
            except Exception:
                log.exception("deferred_requests_check_failed")

    async def _watch(self, view: InstanceView) -> None:
        """An instance whose process ended (its command socket disconnected) is down
        now, not a heartbeat timeout later; one draining exits on purpose."""
        while True:
            await view.pusher.disconnected()
            if view.pid is not None and not view.draining:
                self.instances.mark_dead(view)
                self._instance_down(view.name, "its process ended")

    def _instance_down(self, name: str, why: str) -> None:
        log.error("instance down", instance=name, why=why)
        if self.policy is not None:  # its successor resumes it (hello)
            self._actions.run(self.policy.pause(name))
        self._fail_instance(name, f"instance {name} is down ({why})")

    def _fail_instance(self, name: str, why: str) -> None:
        """Its requests end with an ``instance_failed`` error, except those that had
        no token yet: they are dispatched again (the instance is paused, so they go
        elsewhere or wait for its successor; ``RequestTable.lost``). One placed there
        after its prefill may have been lost before the instance claimed its handoff:
        the prefill instance frees it if it is still leased there (a no-op once
        claimed: the cachemgr refuses that free)."""
        for tracked in [t for t in self.requests.values() if t.instance == name]:
            owner = tracked.handoff_owner
            if owner is not None and owner != name and owner in self.instances.views:
                self._actions.send(owner, CancelRequest(tracked.gen.request_id,
                                                        free_handoff=True))  # fmt: skip
            self.table.lost(tracked, name, why)

    def _free_orphan(self, owner: str, offsets: list[int]) -> None:
        async def free() -> None:
            try:
                await self._cache.call(FreeBlocks(owner, list(offsets), None), timeout_s=5.0)
            except (RemoteError, TimeoutError) as exc:  # (a claimed handoff: refused)
                log.warning("orphan_free_failed", owner=owner, blocks=len(offsets),
                            error=str(exc) or type(exc).__name__)  # fmt: skip

        self._tasks.append(asyncio.get_running_loop().create_task(free()))

    # ---- observability ---------------------------------------------------------
    def health(self) -> dict[str, object]:
        now = time.monotonic()
        return {
            "policy": self.config.scheduler.policy,
            "ready": self.ready(),
            "requests": len(self.requests),
            "instances": {
                v.name: {"alive": v.alive(now), "pid": v.pid,
                         "active_model": v.stats.active_model if v.stats else None}
                for v in self.instances
            },
        }

    def _holdings(self, cache: dict[str, Any] | None) -> list[dict[str, object]]:
        """What each instance holds now: device KV blocks and open sequences (its last
        heartbeat), host KV blocks the cachemgr leases to it (``-1``: the cachemgr did
        not answer). All 0 on an idle node that leaked nothing."""
        now = time.monotonic()
        owners = (cache or {}).get("kv", {}).get("blocks_per_owner", {})
        out: list[dict[str, object]] = []
        for v in self.instances:
            held = v.holdings or Holdings(0, 0, 0)
            out.append({
                "name": v.name, "kind": v.kind, "index": v.index, "pid": v.pid,
                "alive": v.alive(now), "draining": v.draining,
                "kv_blocks_in_use": held.kv_blocks_in_use,
                "leases": int(owners.get(v.name, 0)) if cache is not None else -1,
                "open_sequences": held.open_sequences,
                "role": self.roles.role(v.name),
            })  # fmt: skip
        return out

    async def stats(self, light: bool = False) -> dict[str, object]:
        """Everything the benchmarks read: instance counters, switches, turns, request
        timings, cache; ``light`` leaves the record lists out (for frequent polls)."""
        cache: dict[str, Any] | None = None
        with contextlib.suppress(RemoteError, TimeoutError):
            reply = await self._cache.call(GetStats(), timeout_s=5.0)
            if isinstance(reply, CacheStats):
                cache = to_plain(reply)
        out: dict[str, object] = {
            "policy": self.config.scheduler.policy,
            "counters": dict(self.counters),
            "open_requests": len(self.requests),
            "instances": self._holdings(cache),
            # each instance's last heartbeat by name (the form readers used before
            # `instances` became the list above)
            "instance_stats": {
                v.name: to_plain(v.stats) if v.stats else None for v in self.instances
            },
            "cache": cache,
            "admission": self.admission.snapshot() if self.admission is not None else None,
            "slo_classes": self.table.classes_snapshot(),
            "roles": self.roles.snapshot(time.monotonic(), cluster_velocity(
                v.stats.velocity for v in self.instances if v.stats is not None)),
        }
        if light:
            return out
        # Each instance's start-up latency profile (aegaeon_sched.LatencyModel
        # dicts): what a simulation of this deployment should use.
        out["latency"] = {
            v.name: to_plain(v.hello.latency)
            for v in self.instances
            if v.hello is not None and v.hello.latency is not None
        }
        out["layout"] = {
            "policy": self.config.scheduler.policy,
            "unified": self.config.unified,
            "hybrid_prefill": self.config.hybrid_prefill,
            "prefill": self.config.prefill.instances,
            "decode": self.config.decode.instances,
            "q_max_s": self.config.scheduler.q_max_s,
            "max_group_size": self.config.scheduler.max_group_size,
            "max_batch_size": self.config.scheduler.max_batch_size,
        }
        out["switches"] = [{"instance": n, **to_plain(r)} for n, r in self.instances.switches]
        out["turns"] = [{"instance": n, **to_plain(r)} for n, r in self.instances.turns]
        out["timings"] = self.table.timings.plain()
        return out
