"""The prefill loop (paper §4.2, Algorithm 1 line 15; §5.3): once, for every role.

The instance mirrors its job queue of groups with the same
:class:`~aegaeon_sched.PrefillQueue` the proxy keeps for it, applying the
proxy's ``EnqueuePrefill(request, group)`` in order. It runs the front
group's requests one at a time (batch 1): switch the model in if needed,
prefetch the model of the next group, prefill, sample the first token, copy
the prompt's KV out to the unified CPU cache on the swap-out stream and hand
the request off with that copy's event — without waiting for the copy
(:func:`~aegaeon_runtime.prefill.job.run_prefill`).

The front job's device KV blocks are taken before it starts: when the region
is momentarily full (earlier prompts' blocks wait in the move list behind
their copies) it stays queued (``waiting_for_kv``) and is tried again every
``KV_RETRY_S`` while the inbox is served; only a prompt larger than the
region fails (``kv_capacity``).

Two roles run it. A **prefill instance** runs :meth:`PrefillLoop.run`: the
loop alone on its compute thread, its own inbox and heartbeat. A **hybrid
instance** (a prefill instance that decodes when idle, or a decode instance
in the prefill role; docs/design.md "Beyond the paper") holds one inside its
:class:`~aegaeon_runtime.decode.loop.DecodeLoop`, hands it the prefill
commands and gives it strict priority with :meth:`PrefillLoop.run_all` at
every decode step boundary; a prompt that fits the region but not now takes
its room from the instance's own decode sequences (``evict``: swapped out to
the unified CPU cache as a model switch's turn does, back at their next turn).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import (
    AckDrain,
    AddModel,
    CancelRequest,
    EnqueuePrefill,
    ProxyStarted,
    SetModelAwake,
    Shutdown,
)
from aegaeon_common.messages.report import InstanceStats, PrefillDone, RequestFailed
from aegaeon_common.wire import Message
from aegaeon_sched import LatencyModel, PrefillQueue

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.counters import InstanceCounters
from aegaeon_runtime.handoffs import SentHandoffs
from aegaeon_runtime.holdings import HoldingsBook, Reading, used_blocks
from aegaeon_runtime.instance import InstanceLoop
from aegaeon_runtime.metrics import InstanceLoad
from aegaeon_runtime.models import set_awake
from aegaeon_runtime.port import MessageSink, MessageSource, WorkerPort
from aegaeon_runtime.prefill.job import (
    Evict,
    PrefillOutcome,
    prefill_request,
    reserve_blocks,
    run_prefill,
)
from aegaeon_runtime.profile_cache import start_up_profile

log = get_logger("prefill")
IDLE_WAIT_S = 0.05
# A job whose prompt's device blocks are not free yet (freed behind copies still in
# flight) is tried again this often; the wait is the inbox's, so commands are served.
KV_RETRY_S = 0.005
PREFILL_COUNTERS = ("prefills", "prefill_tokens", "prefill_s", "switches", "switch_s",
                    "adapter_loads", "failed")  # fmt: skip


class PrefillLoop(InstanceLoop):
    """The job queue and its runs; see the module docstring.

    ``counters``: the hybrid instance's (its heartbeat reports prefills beside
    its decode work); a prefill instance keeps its own. ``clock`` and ``profile``
    (default: the worker's cached start-up profile) are for tests.
    """

    def __init__(
        self,
        worker: WorkerPort,
        inbox: MessageSource,
        outbox: MessageSink,
        *,
        counters: InstanceCounters | None = None,
        clock: Clock = SYSTEM_CLOCK,
        profile: Callable[[], LatencyModel] | None = None,
    ) -> None:
        super().__init__(worker, inbox, outbox, clock)
        self.counters = counters or InstanceCounters(metrics=worker.metrics)
        self.queue = PrefillQueue(max_group_size=worker.config.scheduler.max_group_size,
                                  default_ttft_s=worker.config.slo.ttft_s)  # fmt: skip
        self.jobs: dict[str, EnqueuePrefill] = {}
        # handoffs sent, until a new proxy starts: it frees those nobody claimed
        self.handoffs = SentHandoffs()
        # The front job waits for device KV blocks (tried again shortly).
        self.waiting_for_kv = False
        # Between two prefills: the commands that arrived meanwhile, so a more urgent
        # group queued behind a deep backlog goes next (SLO classes) and a cancel
        # takes effect before its turn. A hybrid sets its own (its turns' poll).
        self.poll: Callable[[], None] = lambda: self.apply(self.inbox.drain())
        # A hybrid's: swaps its decode sequences out to make room for a prompt.
        self.evict: Evict | None = None
        # a prefill instance's own loop (run)
        self._profile = profile  # None: the worker's start-up profile, when it runs alone
        # what it holds, read into each message that takes a request out of its queue
        # (aegaeon_runtime.holdings); a hybrid sets ``changed`` to its own book's
        self.holdings = HoldingsBook(lambda: used_blocks(worker.kv.pool),
                                     lambda: self.load.prefill_requests)  # fmt: skip
        self.changed: Reading = self._changed
        self._handlers = {
            EnqueuePrefill: self._on_enqueue,
            CancelRequest: self._on_cancel,
            Shutdown: self._on_shutdown,
            AckDrain: self.drain.on_ack,
            AddModel: self._on_add_model,
            ProxyStarted: self._on_proxy_started,
            SetModelAwake: self._on_set_awake,
        }

    # ---- the job queue (both roles) --------------------------------------------
    def enqueue(self, msg: EnqueuePrefill) -> None:
        if msg.model not in self.worker.specs:
            self._fail(msg.request_id, msg.model, "unknown_model",
                       f"model {msg.model!r} is not served")  # fmt: skip
            return
        request = prefill_request(msg, self.worker.unit_of(msg.model))
        try:
            self.queue.add(request, msg.group_id, key_s=msg.group_key_s)
        except ValueError as exc:  # a duplicate id or a group/model mismatch
            self._fail(msg.request_id, msg.model, "bad_request", str(exc))
            return
        self.jobs[msg.request_id] = msg
        if msg.sampling.grammar:  # made on the grammar thread while the job waits its turn
            self.worker.grammars.prepare(msg.model, msg.sampling.grammar)
        self.worker.metrics.tokens("arrival", msg.model, len(msg.prompt_token_ids))

    def cancel(
        self, request_id: str, free_handoff: bool = False, in_use: Collection[int] = ()
    ) -> bool:
        """Out of the queue (True if it was there); ``free_handoff``: its sent, unclaimed
        handoff is freed too (see ``CancelRequest.free_handoff``), unless its blocks
        are among ``in_use`` (a hybrid's own sequences hold them now)."""
        self.jobs.pop(request_id, None)
        if free_handoff and self.handoffs.free_one(request_id, self.worker.cache, in_use):
            log.info("handoff_freed", request_id=request_id)
        return self.queue.remove(request_id)

    def drop_all(self) -> int:
        """Forget every queued job (a new proxy started). Returns how many."""
        dropped = list(self.jobs)
        for request_id in dropped:
            self.queue.remove(request_id)
        self.jobs.clear()
        return len(dropped)

    def pending(self) -> bool:
        return self.queue.peek() is not None

    def has_model(self, name: str) -> bool:
        """A queued job needs ``name`` (a model, or an adapter of a group's model)."""
        return any(group.model == name or any(r.model == name for r in group.pending)
                   for group in self.queue)

    def run_all(self) -> None:
        """Run every queued job, front group first (Algorithm 1, line 15), the
        commands that arrive between two of them applied (``poll``); stop at one
        whose KV blocks are not free yet (``waiting_for_kv``)."""
        self.waiting_for_kv = False
        while self.run_next():
            self.poll()

    def run_next(self) -> bool:
        """Run the front job; False when there is none or its blocks are not free."""
        head = self.queue.peek()
        if head is None:
            return False
        _, request = head
        msg = self.jobs[request.request_id]
        blocks = reserve_blocks(self.worker, msg, self.evict)
        if blocks is None:
            self.waiting_for_kv = True  # it stays queued, at the front
            return False
        self.waiting_for_kv = False
        self.queue.start(request.request_id, self.clock.wall())
        try:
            del self.jobs[request.request_id]
            if isinstance(blocks, PrefillOutcome):
                outcome = blocks  # it can never run here
            else:
                unit = self.worker.unit_of(msg.model)
                nxt = next((g.model for g in self.queue if g.model != unit), None)
                loads = self.worker.adapters.num_loads
                outcome = run_prefill(self.worker, msg, blocks, nxt, self.clock)
                with self.counters.lock:
                    self.counters.adapter_loads += self.worker.adapters.num_loads - loads
        finally:
            self.queue.finish(request.request_id)
        if outcome.switch is not None:
            self.counters.note_switch(outcome.switch)
        done = isinstance(outcome.message, PrefillDone)
        if isinstance(outcome.message, PrefillDone):
            self.handoffs.record(msg.request_id, outcome.message.handoff)
        # out of the queue, its blocks freed or on their way out: what is left goes with it
        self.outbox.send(msgspec.structs.replace(outcome.message, holdings=self.changed()))
        metrics = self.worker.metrics
        metrics.request_done("prefill", msg.model, "ok" if done else "failed")
        c = self.counters
        if done:
            metrics.tokens("prefill", msg.model, outcome.num_tokens)
            with c.lock:
                c.prefills += 1
                c.prefill_tokens += outcome.num_tokens
                c.prefill_s += outcome.compute_s
        else:
            with c.lock:
                c.failed += 1
        return True

    def _fail(self, request_id: str, model: str, code: str, message: str) -> None:
        self.worker.metrics.request_done("prefill", model, "failed")
        with self.counters.lock:
            self.counters.failed += 1
        w = self.worker
        self.outbox.send(RequestFailed(request_id, w.kind, w.index, code, message,
                                       self.changed()))  # fmt: skip

    # ---- a prefill instance's own loop ---------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.latency = (self._profile or start_up_profile(self.worker))()
        self.ready.set()
        while not (stop.is_set() or self._stop.is_set()):
            if self.pending() and self.waiting_for_kv:
                self.apply(self.inbox.wait(KV_RETRY_S))
            else:
                self.apply(self.inbox.drain() if self.pending() else
                            self.inbox.wait(IDLE_WAIT_S))  # fmt: skip
            self._publish_load()
            self.snapshots.offer(lambda: (msgspec.msgpack.encode(self.queue), None))
            self.counters.queued = len(self.queue)
            self.counters.running = int(self.pending())
            if not self.pending():
                self.waiting_for_kv = False
                if self.drain.done(idle=True):
                    return  # drained: the queue is empty and nothing more comes
                continue
            self.run_next()

    def _publish_load(self) -> None:
        self.load = InstanceLoad(len(self.queue), sum(1 for _ in self.queue))

    def _on_enqueue(self, msg: Message) -> None:
        assert isinstance(msg, EnqueuePrefill)
        self.enqueue(msg)

    def _on_cancel(self, msg: Message) -> None:
        assert isinstance(msg, CancelRequest)
        self.cancel(msg.request_id, msg.free_handoff)

    def _on_proxy_started(self, msg: Message) -> None:
        """A new proxy (it sends this before any work): what the queue holds and the
        handoffs sent so far are an old proxy's; nobody will end or claim them."""
        if not self._new_proxy(msg):
            return
        dropped = self.drop_all()
        freed = self.handoffs.free_unclaimed(self.worker.cache)
        if dropped or freed:
            log.info("old_proxy_work_dropped", queued=dropped, handoffs_freed=freed)

    def _on_set_awake(self, msg: Message) -> None:
        assert isinstance(msg, SetModelAwake)
        self.outbox.send(set_awake(self.worker, msg, self.has_model, idle=not self.pending()))

    def stats(self) -> InstanceStats:
        """A prefill instance's heartbeat: its prefill counters only."""
        snapshot = self.counters.snapshot(self.worker)
        counters = {key: snapshot.counters[key] for key in PREFILL_COUNTERS}
        return msgspec.structs.replace(snapshot, kind="prefill", counters=counters, turns=[])
