"""A prefill instance's compute loop (paper §4.2, Algorithm 1 line 15; §5.3).

The instance mirrors its job queue of groups with the same
:class:`~aegaeon_sched.PrefillQueue` the proxy keeps for it, applying the
proxy's ``EnqueuePrefill(request, group)`` in order. It runs the front
group's requests one at a time (batch 1): switch the model in if needed,
prefetch the model of the next group, prefill, sample the first token, copy
the prompt's KV out to the unified CPU cache on the swap-out stream and hand
the request off with that copy's event — without waiting for the copy.

The front job's device KV blocks are taken before it starts: when the region
is momentarily full (earlier prompts' blocks wait in the move list behind
their copies) it stays queued and is tried again every ``KV_RETRY_S`` while
the inbox is served; only a prompt larger than the region fails (``kv_capacity``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import (
    AckDrain,
    AddModel,
    CancelRequest,
    EnqueuePrefill,
    ProxyStarted,
    Shutdown,
)
from aegaeon_common.messages.report import (
    InstanceStats,
    PrefillDone,
    RequestFailed,
    SwitchRecord,
)
from aegaeon_common.wire import Message
from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.drain import Drain
from aegaeon_runtime.handoffs import SentHandoffs
from aegaeon_runtime.metrics import InstanceLoad
from aegaeon_runtime.models import add_model
from aegaeon_runtime.port import MessageSink, MessageSource, WorkerPort
from aegaeon_runtime.prefill import (
    PrefillOutcome,
    prefill_request,
    reserve_blocks,
    run_prefill,
)
from aegaeon_runtime.profile_cache import start_up_profile
from aegaeon_sched import LatencyModel, PrefillQueue, Request

log = get_logger("prefill")
IDLE_WAIT_S = 0.05
# A job whose prompt's device blocks are not free yet (freed behind copies still in
# flight) is tried again this often; the wait is the inbox's, so commands are served.
KV_RETRY_S = 0.005


@dataclass
class Counters:
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    switches: int = 0
    switch_s: float = 0.0
    failed: int = 0
    new_switches: list[SwitchRecord] = field(default_factory=list)


class PrefillLoop:
    """Runs on the compute thread; see the module docstring. ``clock`` and
    ``profile`` (default: the worker's cached start-up profile) are for tests."""

    def __init__(
        self,
        worker: WorkerPort,
        inbox: MessageSource,
        outbox: MessageSink,
        *,
        clock: Clock = SYSTEM_CLOCK,
        profile: Callable[[], LatencyModel] | None = None,
    ) -> None:
        self.worker = worker
        self.clock = clock
        self._profile = profile or start_up_profile(worker)
        self.inbox = inbox
        self.outbox = outbox
        self.queue = PrefillQueue(worker.config.scheduler.max_group_size,
                                  worker.config.slo.ttft_s)  # fmt: skip
        self.jobs: dict[str, EnqueuePrefill] = {}
        self.counters = Counters()
        self._lock = threading.Lock()  # counters are read by the heartbeat
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.latency: LatencyModel | None = None
        self._depth = (0, 0)  # (queued, running): written here, read by the heartbeat
        self.load = InstanceLoad()  # written here, read by a scrape
        self.drain = Drain()
        self.metrics = worker.metrics
        # handoffs sent, until a new proxy starts: it frees those nobody claimed
        self.handoffs = SentHandoffs()
        self._proxy = 0  # the proxy process that last said it started
        self._handlers = {
            EnqueuePrefill: self._on_enqueue,
            CancelRequest: self._on_cancel,
            Shutdown: self._on_shutdown,
            AckDrain: self.drain.on_ack,
            AddModel: self._on_add_model,
            ProxyStarted: self._on_proxy_started,
        }

    # ---- commands --------------------------------------------------------
    def _on_enqueue(self, msg: Message) -> None:
        assert isinstance(msg, EnqueuePrefill)
        if msg.model not in self.worker.specs:
            self._fail(msg.request_id, msg.model, "unknown_model",
                       f"model {msg.model!r} is not served")  # fmt: skip
            return
        request = prefill_request(msg)
        try:
            self.queue.add(request, msg.group_id)
        except ValueError as exc:  # a duplicate id or a group/model mismatch
            self._fail(msg.request_id, msg.model, "bad_request", str(exc))
            return
        self.jobs[msg.request_id] = msg
        self.metrics.tokens("arrival", msg.model, len(msg.prompt_token_ids))

    def _on_cancel(self, msg: Message) -> None:
        assert isinstance(msg, CancelRequest)
        self.queue.remove(msg.request_id)
        self.jobs.pop(msg.request_id, None)
        if msg.free_handoff and self.handoffs.free_one(msg.request_id, self.worker.cache):
            log.info("handoff_freed", request_id=msg.request_id)

    def _on_shutdown(self, msg: Message) -> None:
        self._stop.set()

    def _on_proxy_started(self, msg: Message) -> None:
        """A new proxy (it sends this before any work): what the queue holds and the
        handoffs sent so far are an old proxy's; nobody will end or claim them."""
        assert isinstance(msg, ProxyStarted)
        if msg.proxy == self._proxy:
            return
        self._proxy = msg.proxy
        dropped = list(self.jobs)
        for request_id in dropped:
            self.queue.remove(request_id)
        self.jobs.clear()
        freed = self.handoffs.free_unclaimed(self.worker.cache)
        if dropped or freed:
            log.info("old_proxy_work_dropped", queued=len(dropped), handoffs_freed=freed)

    def _on_add_model(self, msg: Message) -> None:
        assert isinstance(msg, AddModel)
        self.outbox.send(add_model(self.worker, self.latency, msg))

    def _apply(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self._handlers[type(msg)](msg)

    # ---- the loop ----------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.latency = self._profile()
        self.ready.set()
        waiting_for_kv = False
        while not (stop.is_set() or self._stop.is_set()):
            head = self.queue.peek()
            if head and waiting_for_kv:
                self._apply(self.inbox.wait(KV_RETRY_S))
            else:
                self._apply(self.inbox.drain() if head else self.inbox.wait(IDLE_WAIT_S))
            head = self.queue.peek()
            self._depth = (len(self.queue), 1 if head else 0)
            self.load = InstanceLoad(len(self.queue), sum(1 for _ in self.queue))
            waiting_for_kv = False
            if head is None:
                if self.drain.done(idle=True):
                    return  # drained: the queue is empty and nothing more comes
                continue
            _, request = head
            blocks = reserve_blocks(self.worker, self.jobs[request.request_id])
            if blocks is None:
                waiting_for_kv = True  # it stays queued, at the front: tried again shortly
                continue
            self.queue.start(request.request_id, self.clock.wall())
            try:
                self._prefill(request, blocks)
            finally:
                self.queue.finish(request.request_id)

    def _next_model(self, current: str) -> str | None:
        """The model of the first queued group that differs from ``current``."""
        return next((g.model for g in self.queue if g.model != current), None)

    def _prefill(self, request: Request, blocks: list[int] | PrefillOutcome) -> None:
        msg = self.jobs.pop(request.request_id)
        if isinstance(blocks, PrefillOutcome):
            outcome = blocks  # it can never run here
        else:
            nxt = self._next_model(msg.model)
            outcome = run_prefill(self.worker, msg, blocks, nxt, self.clock)
        if outcome.switch is not None:
            self._note_switch(outcome.switch)
        if isinstance(outcome.message, PrefillDone):
            self.handoffs.record(msg.request_id, outcome.message.handoff)
        self.outbox.send(outcome.message)
        done = isinstance(outcome.message, PrefillDone)
        self.metrics.request_done("prefill", msg.model, "ok" if done else "failed")
        if done:
            self.metrics.tokens("prefill", msg.model, outcome.num_tokens)
        with self._lock:
            if done:
                self.counters.prefills += 1
                self.counters.prefill_tokens += outcome.num_tokens
                self.counters.prefill_s += outcome.compute_s
            else:
                self.counters.failed += 1

    def _note_switch(self, record: SwitchRecord) -> None:
        self.metrics.switch(record)
        with self._lock:
            self.counters.switches += 1
            self.counters.switch_s += record.total_s
            self.counters.new_switches.append(record)

    def _fail(self, request_id: str, model: str, code: str, message: str) -> None:
        self.metrics.request_done("prefill", model, "failed")
        with self._lock:
            self.counters.failed += 1
        self.outbox.send(RequestFailed(request_id, "prefill", self.worker.index, code, message))

    # ---- heartbeat -----------------------------------------------------------
    def stats(self) -> InstanceStats:
        with self._lock:
            c = self.counters
            switches, c.new_switches = c.new_switches, []
            counters = {
                "prefills": float(c.prefills),
                "prefill_tokens": float(c.prefill_tokens),
                "prefill_s": c.prefill_s,
                "switches": float(c.switches),
                "switch_s": c.switch_s,
                "failed": float(c.failed),
            }
        return InstanceStats(
            kind="prefill",
            index=self.worker.index,
            active_model=self.worker.switcher.active_model,
            queued=self._depth[0],
            running=self._depth[1],
            counters=counters,
            switches=switches,
        )

