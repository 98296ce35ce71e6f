"""A decode instance's compute loop: rounds of turns (paper §4.3, Algorithm 2).

The instance mirrors its work list of per-model batches with the proxy's
:class:`~aegaeon_sched.DecodeWorkList` (same ``add(request, batch)`` calls).
Each round the :class:`~aegaeon_sched.RoundRobinPlanner` groups same-model
batches and gives each a quota (Eq. 2-3); each turn switches the batch's
model in (prefetching the next turn's model behind it), swaps its requests'
KV in, and decodes it with continuous batching for its quota, streaming
tokens every step. Requests join as soon as their own KV has arrived.

Under request-level policies the same loop serves ``RunRequest``: the
request is prefilled here first and its batch holds the instance's only
model (the policy gives an instance one model at a time).

A hybrid instance (a prefill instance decoding when idle) plans its rounds for
the share of its time its prefills leave (:class:`~aegaeon_sched.DecodeShare`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from aegaeon_common.messages.decode import EnqueueDecode, RunRequest
from aegaeon_common.messages.prefill import AckDrain, CancelRequest, EnqueuePrefill, Shutdown
from aegaeon_common.messages.report import InstanceStats
from aegaeon_common.wire import Message
from aegaeon_sched import (
    BatchLoad,
    DecodeBatch,
    DecodeShare,
    DecodeWorkList,
    LatencyModel,
    RoundRobinPlanner,
    ServedInRound,
)

from aegaeon_runtime.bridge import Inbox, Outbox
from aegaeon_runtime.decode.admit import Admission
from aegaeon_runtime.decode.prefill_side import PrefillSide
from aegaeon_runtime.decode.residency import Residency
from aegaeon_runtime.decode.stats import DecodeCounters
from aegaeon_runtime.decode.turn import TurnRunner
from aegaeon_runtime.drain import Drain
from aegaeon_runtime.metrics import InstanceLoad
from aegaeon_runtime.profile_cache import cached_profile
from aegaeon_runtime.worker import Worker

IDLE_WAIT_S = 0.05


class DecodeLoop:
    """Runs on the compute thread; see the module docstring."""

    def __init__(
        self, worker: Worker, inbox: Inbox[Message], outbox: Outbox, hybrid: bool = False
    ) -> None:
        config = worker.config
        self.worker = worker
        self.inbox = inbox
        self.outbox = outbox
        self.work = DecodeWorkList()
        # Eq. 2-3 plus the round bound (rounds within 0.7 x TTFT; see aegaeon_sched.quota).
        self.planner = RoundRobinPlanner(
            config.slo.tbt_s,
            config.scheduler.q_max_s,
            ttft_s=config.slo.ttft_s,
            round_ttft_fraction=config.scheduler.round_ttft_fraction,
        )
        self.counters = DecodeCounters(metrics=worker.metrics)
        self.residency = Residency(worker)
        self.admission = Admission(worker, self.work, self.residency, outbox, self.counters)
        self.turns = TurnRunner(
            worker, self.work, self.admission, self.residency, outbox, self.counters
        )
        # A hybrid instance (a prefill instance decoding when idle) runs prefills first.
        self.prefill = PrefillSide(worker, outbox, self.counters) if hybrid else None
        if self.prefill is not None:
            self.turns.preempt = self.prefill.pending
        # Its prefills take part of its time: rounds are planned for the rest.
        self._share = DecodeShare()
        # After a round cut short (a prefill first, a new batch) the batches that
        # have not had a turn since the last complete round go first.
        self._served = ServedInRound()
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.latency: LatencyModel | None = None
        self.load = InstanceLoad()  # written here, read by a scrape
        self.drain = Drain()
        self._handlers: dict[type[Message], Callable[[Message], None]] = {
            EnqueueDecode: self.admission.enqueue,
            RunRequest: self.admission.run_request,
            CancelRequest: self._on_cancel,
            EnqueuePrefill: self._on_enqueue_prefill,
            Shutdown: self._on_shutdown,
            AckDrain: self.drain.on_ack,
        }

    def _on_cancel(self, msg: Message) -> None:
        assert isinstance(msg, CancelRequest)
        if self.prefill is not None and self.prefill.cancel(msg.request_id):
            return
        self.admission.cancel(msg)

    def _on_enqueue_prefill(self, msg: Message) -> None:
        assert isinstance(msg, EnqueuePrefill)
        if self.prefill is None:
            self.admission.refuse(msg.request_id, "bad_request", "not a prefill instance")
            return
        self.prefill.enqueue(msg)

    def _on_shutdown(self, msg: Message) -> None:
        self._stop.set()

    def apply(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self._handlers[type(msg)](msg)

    def run(self, stop: threading.Event) -> None:
        self.latency = self.turns.latency = cached_profile(self.worker)
        self.ready.set()
        self.turns.poll = lambda: self.apply(self.inbox.drain())
        while not (stop.is_set() or self._stop.is_set()):
            busy = len(self.work) or (self.prefill is not None and self.prefill.pending())
            self.apply(self.inbox.drain() if busy else self.inbox.wait(IDLE_WAIT_S))
            self._publish_load()
            if self.prefill is not None:
                self.prefill.run_all()
            if not len(self.work):
                if self.drain.done(idle=not self._pending_prefill()):
                    self.admission.tokens.flush()
                    return  # drained: every request finished, nothing more comes
                continue
            self.run_round(stop)
            self._publish_load()

    def _pending_prefill(self) -> bool:
        return self.prefill is not None and self.prefill.pending()

    def _publish_load(self) -> None:
        queue = self.prefill.queue if self.prefill is not None else None
        self.load = InstanceLoad(
            prefill_requests=len(queue) if queue is not None else 0,
            prefill_groups=sum(1 for _ in queue) if queue is not None else 0,
            decode_requests=self.work.num_requests,
            decode_batches=len(self.work),
        )

    def run_round(self, stop: threading.Event) -> None:
        batches = self.work.group_by_model()
        served = self._served.for_plan(b.batch_id for b in batches)
        loads = [
            BatchLoad(b.batch_id, b.model, self.turns.step_estimate(b),
                      served=b.batch_id in served)
            for b in batches
        ]  # fmt: skip
        models = {b.model for b in batches}
        share = 1.0
        if self.prefill is not None:
            share = self._share.observe(time.monotonic(), self.counters.prefill_s)
        switches = {m: self.turns.switch_estimate(m) for m in models}
        plan = self.planner.plan(loads, switches, decode_share=share)
        self.counters.rounds += 1
        order = [t.batch_id for t in plan.turns]
        for i, turn in enumerate(plan.turns):
            if stop.is_set() or self._stop.is_set():
                return
            if self.prefill is not None and self.prefill.pending():
                return  # prefills first; the round is cut (ServedInRound)
            batch = self.work.batch(turn.batch_id)
            if batch is None:
                continue  # every request of it finished or was cancelled
            following = order[i + 1 :] + order[: i + 1]
            self._served.turn_began(batch.batch_id)
            # A round without switches (one model) ends as soon as another
            # model's batch arrives: its quota was never meant to block others.
            watch = len(self.work) if plan.switch_s == 0 else None
            self.turns.run(
                batch, turn.quota_s, self._next_model(batch, following), following, watch
            )
            if watch is not None and len(self.work) > watch:
                return
        self._served.round_ended()

    def _next_model(self, batch: DecodeBatch, following: list[int]) -> str | None:
        for batch_id in following:
            other = self.work.batch(batch_id)
            if other is not None and other.model != batch.model:
                return other.model
        return None

    def stats(self) -> InstanceStats:
        return self.counters.snapshot(self.worker)
