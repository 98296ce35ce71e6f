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
from collections import OrderedDict
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
    ReassignBlocks,
)
from aegaeon_common.messages.decode import EnqueueDecode
from aegaeon_common.messages.prefill import AckDrain, CancelRequest, ProxyStarted
from aegaeon_common.messages.report import (
    REPORT_CHANNEL,
    InstanceDraining,
    InstanceHello,
    InstanceModels,
    InstanceStats,
    ModelsResident,
    PrefillDone,
    RequestFailed,
    StepTokens,
)
from aegaeon_common.messages.structs import SamplingSpec
from aegaeon_common.process import cancel_tasks
from aegaeon_common.transport import Puller, RemoteError, RpcClient, release_security
from aegaeon_common.wire import Message, to_plain
from aegaeon_sched import AegaeonPolicy, DecodeDispatcher, Policy, Request, Shedder, Verdict
from aegaeon_sched.admission import AdmissionControl, ClassAdmission
from prometheus_client import CollectorRegistry

from aegaeon_proxy.backend import BackendError, EngineSnapshot, GenerationRequest, TokenQueue
from aegaeon_proxy.cluster.actions import ActionRunner
from aegaeon_proxy.cluster.collector import ClusterCollector
from aegaeon_proxy.cluster.instances import DecodeShares, Instances, InstanceView
from aegaeon_proxy.cluster.models import ClusterModels
from aegaeon_proxy.cluster.policy import admission_bounds, build_policy
from aegaeon_proxy.cluster.reports import receive_reports
from aegaeon_proxy.cluster.roles import RoleSwitcher
from aegaeon_proxy.cluster.tracked import TimingLog, Tracked, deliver, step_batch
from aegaeon_proxy.slo_classes import class_table
from aegaeon_proxy.vllm_metrics import EngineSteps

log = get_logger("cluster")
MONITOR_S = 0.5
MAX_RETRIES = 2  # dispatches again of a request whose instance failed before its first token
ENGINE_STATS_TIMEOUT_S = 1.0  # the cachemgr's KV stats for a scrape
RECENT_IDS = 4096  # request ids the proxy ended lately (their late tokens are expected)
INCARNATION = secrets.randbits(62) + 1  # this proxy process, in the instances' eyes


class ClusterBackend:
    """A :class:`~aegaeon_proxy.backend.Backend` over prefill/decode instances."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.unified = config.unified
        self.ctx = zmq.asyncio.Context()
        self.instances = Instances.connect(config, self.ctx, self.unified)
        self.requests: dict[str, Tracked] = {}
        self.policy: Policy | None = None
        self.admission: AdmissionControl | None = None  # with the policy
        self.gate: ClassAdmission | None = None  # the admission by SLO class, with it
        # ids ended here lately, oldest first: tokens of an id not in here and not
        # open belong to a request this proxy never knew (it restarted) and are
        # cancelled at their instance, so its KV and compute are freed
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.timings = TimingLog(config.proxy.stats_records)
        self.steps = EngineSteps()  # vllm:iteration_tokens_total, from the reports
        self.counters: dict[str, int] = {"finished": 0, "failed": 0, "cancelled": 0,
                                         "retried": 0, "rejected": 0, "deferred": 0,
                                         "orphans_cancelled": 0, "bad_frames": 0,
                                         "report_errors": 0}  # fmt: skip
        # SLO classes: under overload the lowest class is deferred or refused first
        # (aegaeon_sched.shedding); None with classes off (one class, fraction 1.0)
        # With proxy.admission_wait a request past the bounds (its class's share of them)
        # waits its turn until its first-token deadline instead of a 429 at once; classes
        # off: one class at the whole bounds.
        self.shedder: Shedder | None = None
        wait = config.proxy.admission_wait
        if config.slo_classes.enabled:
            max_deferred = config.slo_classes.max_deferred
            if wait:  # as many as may be open
                max_deferred = max(max_deferred, config.proxy.max_queued_requests)
            self.shedder = Shedder(class_table(config, config.slo.ttft_s, config.slo.tbt_s),
                                   max_deferred, wait_all=wait)  # fmt: skip
        elif wait:
            self.shedder = Shedder.one_class(config.slo.ttft_s, config.slo.tbt_s,
                                             config.proxy.max_queued_requests)  # fmt: skip
        self._releasing = False
        # token velocity and, with roles.enabled, prefill/decode role switching
        if config.roles.enabled and not config.role_switching:
            log.warning("roles.enabled needs the aegaeon policy with "
                        "scheduler.prefill_decodes_when_idle: roles stay fixed")  # fmt: skip
        self.roles = RoleSwitcher(config, self.instances, config.role_switching)
        self._reports = Puller(self.ctx, config.proxy_address, REPORT_CHANNEL, bind=True)
        self._cache = RpcClient(self.ctx, config.cachemgr_address, REPLIES)
        self._tasks: list[asyncio.Task[None]] = []
        self._actions = ActionRunner(self)
        self._shares = DecodeShares()
        # models added and removed at run time
        self.models = ClusterModels(config, self.instances, self._cache, self._actions.send,
                                    lambda: self.policy)  # fmt: skip
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            InstanceHello: self._on_hello,
            InstanceStats: self._on_stats,
            PrefillDone: self._on_prefill_done,
            StepTokens: self._on_step_tokens,
            RequestFailed: self._on_failed,
            InstanceDraining: self._on_draining,
            InstanceModels: self.models.on_instance_models,
            ModelsResident: self.models.on_models_resident,
        }

    # ---- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._receive()), loop.create_task(self._monitor())]
        self._tasks += [loop.create_task(self._watch(view)) for view in self.instances]

    async def stop(self) -> None:
        for tracked in list(self.requests.values()):
            tracked.queue.finish("cancelled")
        self.requests.clear()
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
        """Every instance is up, or restarting after a drain (its work waits here)."""
        return self.policy is not None and self.instances.all_alive()

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(ClusterCollector(self))
        self.steps.register(registry)

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
        arrivals = getattr(self.policy, "held_arrivals", {})
        placements = getattr(self.policy, "held_placements", {})
        return len(arrivals), len(placements)

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

    # ---- sleep and wake (ModelResidency; cluster.models) -------------------------
    async def set_model_awake(self, name: str, awake: bool) -> bool:
        return await self.models.set_awake(name, awake)

    def model_sleeping(self, name: str) -> bool:
        return self.models.sleeping(name)

    # ---- requests ------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> TokenQueue:
        if not self.ready() or self.policy is None:
            down = [v.name for v in self.instances if not v.alive(time.monotonic())]
            what = ", ".join(down) or "starting"
            raise BackendError.unavailable(f"instances unavailable: {what}")
        retry_after_s = self.config.proxy.retry_after_s
        if len(self.requests) >= self.config.proxy.max_queued_requests:
            self.counters["rejected"] += 1
            raise BackendError.overloaded(
                f"{len(self.requests)} requests in flight (limit "
                f"{self.config.proxy.max_queued_requests})",
                retry_after_s=retry_after_s,
            )
        s = req.sampling
        sched = Request(
            req.request_id, req.model, req.arrival_s, len(req.prompt_token_ids), s.max_tokens,
            oracle_output_len=s.max_tokens if s.ignore_eos else None,
            priority=req.priority, ttft_s=req.ttft_s, tbt_s=req.tbt_s,
        )  # fmt: skip
        assert self.gate is not None  # made with the policy
        verdict = self.gate.decide(sched)
        if verdict is Verdict.REFUSE:
            self.counters["rejected"] += 1
            why = self.gate.why(sched)
            raise BackendError.overloaded(
                f"the node is at its admission bound for {req.slo_class} requests ({why}); "
                "retry later", retry_after_s=retry_after_s,
            )  # fmt: skip
        sampling = SamplingSpec(
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
            top_k=max(s.top_k, 0), seed=s.seed, stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        )  # fmt: skip
        tracked = Tracked(req, sched, sampling, TokenQueue())
        self.requests[req.request_id] = tracked
        self.roles.arrived(time.monotonic(), sched.prompt_len)
        if verdict is Verdict.DEFER:  # it waits here for room (Shedder.release)
            tracked.deferred = True
            tracked.queue.hold()  # the front answers once it is admitted or refused
            self.counters["deferred"] += 1
            log.debug("request_deferred", request_id=req.request_id, model=req.model,
                      slo_class=req.slo_class)  # fmt: skip
            return tracked.queue
        self._dispatch(tracked)
        return tracked.queue

    def _dispatch(self, tracked: Tracked, admitted: bool = False) -> None:
        """Admit it (unless ``admitted`` already) and hand it to the policy."""
        assert self.policy is not None and self.gate is not None
        if not admitted:
            self.gate.admit(tracked.sched)
        tracked.queue.admit()
        self._actions.run(self.policy.on_arrival(tracked.sched, time.time()))

    def _release_deferred(self) -> None:
        """Room was freed: deferred requests that fit now go out, earliest deadline first."""
        gate = self.gate
        if gate is None or self._releasing or not gate.num_deferred:
            return
        self._releasing = True  # dispatching may end requests (Reject): no re-entry
        try:
            while gate.num_deferred:
                released = gate.release()
                if not released:
                    break
                for sched in released:
                    tracked = self.requests.get(sched.request_id)
                    if tracked is not None and tracked.deferred:
                        tracked.deferred = False
                        self._dispatch(tracked, admitted=True)
                    elif self.admission is not None:  # gone meanwhile
                        self.admission.release(sched.request_id)
        finally:
            self._releasing = False

    async def cancel(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        if tracked is None or self.policy is None:
            return
        self._forget(request_id)
        self.counters["cancelled"] += 1
        self.timings.add(tracked, "cancelled", None)
        if tracked.deferred and self.gate is not None:
            self.gate.cancel(request_id)  # it never reached the policy
        else:
            self._actions.run(self.policy.on_request_cancelled(request_id, time.time()))
        tracked.queue.finish("cancelled")
        self._release_deferred()

    def end_request(
        self, request_id: str, reason: str, error: str | None = None, code: str | None = None
    ) -> Tracked | None:
        """The request is over (finished or failed): tell the policy, close the stream."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        self._forget(request_id)
        if reason == "error":
            self.counters["failed"] += 1
            tracked.queue.finish("error", error, code)
        else:
            self.counters["finished"] += 1
        if tracked.deferred and self.gate is not None:
            self.gate.cancel(request_id)
        elif self.policy is not None:
            self._actions.run(self.policy.on_request_finished(request_id, time.time()))
        self._release_deferred()
        return tracked

    def _forget(self, request_id: str) -> None:
        """It ended here: release its admission, remember its id for a while."""
        if self.admission is not None:
            self.admission.release(request_id)
        self._ended[request_id] = None
        if len(self._ended) > RECENT_IDS:
            self._ended.popitem(last=False)

    def _cancel_orphan(self, request_id: str, index: int) -> None:
        """Tokens of a request this proxy does not know (it was restarted while the
        request ran): cancel it at the instance that sent them (prefill-i or decode-i:
        a report names only the index; a cancel of an unknown id is a no-op)."""
        if request_id in self._ended:
            return  # ended here; the instance already got its cancel
        self._forget(request_id)
        self.counters["orphans_cancelled"] += 1
        log.info("orphan_cancelled", request_id=request_id, index=index)
        for kind in ("prefill", "decode"):
            if self.instances.get(kind, index) is not None:
                self._actions.send(f"{kind}-{index}", CancelRequest(request_id))

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
            self.admission = AdmissionControl(admission_bounds(self.config, self.instances))
            self.gate = ClassAdmission(self.admission, self.shedder)
            log.info("policy ready", policy=self.policy.name,
                     admission=self.admission.snapshot()["bounds"])  # fmt: skip
            pause = getattr(self.policy, "pause", None)
            for other in self.instances:  # drained or died before the policy existed
                if other.paused and pause is not None:
                    self._actions.run(pause(other.name))
        if view.paused and not view.draining:  # back from a drain or from the dead
            view.paused = False
            resume = getattr(self.policy, "resume", None)
            if resume is not None:
                self._actions.run(resume(view.name, time.time()))
            log.info("instance_rejoined", instance=view.name, pid=msg.pid)
        self.models.on_hello(view, msg)

    def _on_draining(self, msg: InstanceDraining) -> None:
        """Send the instance no new work; the ack follows everything sent to it so far."""
        view = self.instances.on_draining(msg.kind, msg.index, msg.pid, msg.timeout_s)
        if view is None:
            return
        pause = getattr(self.policy, "pause", None)
        if pause is not None:
            self._actions.run(pause(view.name))
        held = sum(1 for t in self.requests.values() if t.instance == view.name)
        log.info("instance_draining", instance=view.name, pid=msg.pid, requests=held)
        self._actions.send(view.name, AckDrain(msg.pid))

    def _on_stats(self, msg: InstanceStats) -> None:
        view = self.instances.on_stats(msg)
        if view is None:
            return
        # a prefill instance decodes when idle; with roles moving, a decode one prefills
        prefills = msg.kind == "prefill" or self.config.role_switching
        if self.config.hybrid_prefill and prefills:
            share = self._shares.observe(view.name, msg.counters.get("prefill_s", 0.0))
            dispatcher = getattr(self.policy, "decode", None)
            if isinstance(dispatcher, DecodeDispatcher):
                dispatcher.set_decode_share(view.name, share)
        now = time.monotonic()
        self.roles.heartbeat(view, now)
        if isinstance(self.policy, AegaeonPolicy):
            views = list(self.instances)
            steady = all(v.alive(now) and not v.paused for v in views)
            for change in self.roles.observe(now, self.policy, views, steady):
                self._actions.run(self.policy.set_role(change.instance, change.role, time.time()))

    def _on_prefill_done(self, msg: PrefillDone) -> None:
        tracked = self.requests.get(msg.request_id)
        if tracked is None or tracked.num_generated > 0:
            # cancelled meanwhile, or a second prefill of it (work queued for an
            # instance that died reached its successor): nobody will claim this KV
            if msg.handoff is not None:
                self._free_orphan(f"{msg.kind}-{msg.index}", msg.handoff.block_offsets)
            return
        if self.admission is not None:
            self.admission.prefilled(msg.request_id)
            self._release_deferred()
        tracked.num_generated = 1
        # (a decode instance prefills too when roles move: the blocks are its own)
        tracked.handoff_owner = f"{msg.kind}-{msg.index}"
        tracked.first_token_id = msg.token_id
        tracked.handoff = msg.handoff
        tracked.prefill_timings = msg.timings
        self.steps.prefill(tracked.gen.model, len(tracked.gen.prompt_token_ids))
        deliver(tracked, (msg.token_id,), msg.finish_reason)
        if msg.finish_reason is not None:
            self.timings.add(tracked, msg.finish_reason, msg.timings)
            self.end_request(msg.request_id, msg.finish_reason)
            return
        assert self.policy is not None
        instance = tracked.instance or ""
        measured = msg.timings.extra.get("prefill_compute_s", msg.timings.prefill_s)
        self._actions.run(
            self.policy.on_prefill_done(instance, msg.request_id, measured, time.time())
        )

    def _on_step_tokens(self, msg: StepTokens) -> None:
        batch = step_batch(msg, self.requests)
        if batch is not None:
            self.steps.decode(*batch)
        for item in msg.items:
            tracked = self.requests.get(item.request_id)
            if tracked is None:
                if item.finish_reason is None:
                    self._cancel_orphan(item.request_id, msg.index)
                continue  # cancelled; the instance already got the cancel
            tracked.num_generated += len(item.token_ids)
            reason = item.finish_reason
            deliver(tracked, item.token_ids, reason, item.timings)
            if reason is not None:
                self.timings.add(tracked, reason, item.timings)
                self.end_request(item.request_id, reason)

    def _on_failed(self, msg: RequestFailed) -> None:
        tracked = self.requests.get(msg.request_id)
        if tracked is not None:
            self.timings.add(tracked, "error", None)
            log.warning(
                "request_failed", request_id=msg.request_id, model=tracked.gen.model,
                instance=f"{msg.kind}-{msg.index}", code=msg.code, error=msg.message,
            )  # fmt: skip
        where = f"{msg.kind}-{msg.index}"
        self.end_request(msg.request_id, "error", f"{where}: {msg.code}: {msg.message}")

    # ---- failures --------------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_S)
            for view in self.instances.newly_dead():
                self._instance_down(view.name, "its heartbeat stopped")
            try:  # (room is freed by events; this is a safety net, which must not die)
                self._release_deferred()
                self._expire_deferred()
            except Exception:
                log.exception("deferred_requests_check_failed")

    def _expire_deferred(self) -> None:
        """Deferred requests whose first-token deadline passed while they waited: they
        can no longer meet it, and are refused now (429, Retry-After)."""
        if self.gate is None:
            return
        for sched in self.gate.expire(time.time()):
            tracked = self.requests.pop(sched.request_id, None)
            if tracked is None:
                continue
            self._forget(sched.request_id)
            self.counters["rejected"] += 1
            tracked.queue.refuse(BackendError.overloaded(
                f"the node had no room for this request within its time to first token "
                f"({sched.ttft_s or self.config.slo.ttft_s:g} s; it waited for room at the "
                "admission bounds); retry later",
                retry_after_s=self.config.proxy.retry_after_s,
            ))  # fmt: skip

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
        pause = getattr(self.policy, "pause", None)
        if pause is not None:  # its successor resumes it (hello)
            self._actions.run(pause(name))
        self._fail_instance(name, f"instance {name} is down ({why})")

    def _fail_instance(self, name: str, why: str) -> None:
        """Its requests end with an ``instance_failed`` error, except those that had
        no token yet: they are dispatched again (the instance is paused, so they go
        elsewhere or wait for its successor), up to ``MAX_RETRIES`` times."""
        for request_id in [r for r, t in self.requests.items() if t.instance == name]:
            tracked = self.requests[request_id]
            if (tracked.num_generated == 0 and tracked.retries < MAX_RETRIES
                    and self.policy is not None):  # fmt: skip
                self._redispatch(tracked, name)
                continue
            log.warning("request_lost", request_id=request_id, model=tracked.gen.model,
                        instance=name, error=why)  # fmt: skip
            self.end_request(request_id, "error", why, code="instance_failed")

    def _redispatch(self, tracked: Tracked, name: str) -> None:
        assert self.policy is not None
        request_id = tracked.gen.request_id
        tracked.retries += 1
        tracked.instance = None
        self.counters["retried"] += 1
        if self.admission is not None:
            self.admission.requeued(request_id, len(tracked.gen.prompt_token_ids))
        log.info("request_retried", request_id=request_id, model=tracked.gen.model,
                 instance=name, attempt=tracked.retries)  # fmt: skip
        now = time.time()
        self._actions.run(self.policy.on_request_cancelled(request_id, now))
        self._actions.run(self.policy.on_arrival(tracked.sched, now))

    async def claim_handoff(self, instance: str, msg: EnqueueDecode) -> bool:
        """Lease ``msg``'s handoff blocks to ``instance`` before it is sent there (the
        ActionRunner's pump calls this in order): whatever becomes of the message, the
        blocks are freed with the instance's lease. False: the blocks are gone (their
        prefill instance died), the request fails here."""
        tracked = self.requests.get(msg.request_id)
        owner = tracked.handoff_owner if tracked is not None else None
        if tracked is None or owner is None or owner == instance:
            # (cancelled since it was placed: its cancel follows this message, and the
            # instance frees the blocks it takes over)
            return True
        offsets = list(msg.handoff.block_offsets)
        try:
            await self._cache.call(ReassignBlocks(offsets, instance, owner), timeout_s=2.0)
        except RemoteError as exc:
            if exc.code in ("bad_request", "not_owner"):  # reclaimed: nothing to decode from
                self.end_request(msg.request_id, "error", f"its KV was lost: {exc}",
                                 code="instance_failed")  # fmt: skip
                return False
        except TimeoutError:
            pass  # no cachemgr: the instance claims them itself, as before
        else:
            tracked.handoff_owner = instance
        return True

    def _free_orphan(self, owner: str, offsets: list[int]) -> None:
        async def free() -> None:
            with contextlib.suppress(RemoteError, TimeoutError):
                await self._cache.call(FreeBlocks(owner, list(offsets), None), timeout_s=5.0)

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
            counters = v.stats.counters if v.stats is not None else {}
            out.append({
                "name": v.name, "kind": v.kind, "index": v.index, "pid": v.pid,
                "alive": v.alive(now), "draining": v.draining,
                "kv_blocks_in_use": int(counters.get("kv_blocks_in_use", 0)),
                "leases": int(owners.get(v.name, 0)) if cache is not None else -1,
                "open_sequences": int(counters.get("open_sequences", 0)),
                "role": self.roles.role(v.name),
            })  # fmt: skip
        return out

    def _classes_snapshot(self) -> dict[str, object]:
        """SLO classes: whether on, requests open by class, what shedding did."""
        by_class: dict[str, int] = {}
        for t in self.requests.values():
            by_class[t.gen.slo_class] = by_class.get(t.gen.slo_class, 0) + 1
        out: dict[str, object] = {"enabled": self.config.slo_classes.enabled,
                                  "open_by_class": by_class}  # fmt: skip
        if self.shedder is not None:
            out["shedding"] = self.shedder.snapshot()
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
            "slo_classes": self._classes_snapshot(),
            "roles": self.roles.snapshot(time.monotonic(), list(self.instances)),
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
        out["timings"] = [
            {"request_id": r.request_id, "model": r.model, "arrival_s": r.arrival_s,
             "finish_reason": r.finish_reason, "num_tokens": r.num_tokens,
             **to_plain(r.timings)}
            for r in self.timings.records
        ]  # fmt: skip
        return out
