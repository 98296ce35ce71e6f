"""The prefill work of a hybrid instance: a prefill instance that decodes when idle.

Beyond the paper (DESIGN.md "Beyond the paper"; TokenScale and HyperFlexis
move capacity between the phases): with few workers, a prefill instance idle
between prompts is decode capacity lost. A hybrid instance keeps Algorithm 1's
job queue (the same :class:`~aegaeon_sched.PrefillQueue` mirror a prefill
instance keeps) and gives it strict priority: a queued prefill runs at the
next decode step boundary (the turn in progress ends), so TTFT sees at most
one decode step of delay; the instance decodes only when no prefill waits.

A prompt that fits the device KV region but not now takes its room from the
instance's own decode sequences: they are swapped out to the unified CPU cache
(as a model switch's turn does to another batch) and swapped back in at their
next turn. Until their blocks are back (the copies complete) the prefill stays
queued (``waiting_for_kv``) and the instance decodes nothing: a swap-in would
take the blocks the prefill waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import EnqueuePrefill
from aegaeon_common.messages.report import PrefillDone, RequestFailed
from aegaeon_sched import PrefillQueue

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.decode.stats import DecodeCounters
from aegaeon_runtime.handoffs import SentHandoffs
from aegaeon_runtime.port import MessageSink, WorkerPort
from aegaeon_runtime.prefill import (
    Evict,
    PrefillOutcome,
    prefill_request,
    reserve_blocks,
    run_prefill,
)

log = get_logger("decode")


class PrefillSide:
    def __init__(
        self,
        worker: WorkerPort,
        outbox: MessageSink,
        counters: DecodeCounters,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.worker = worker
        self.clock = clock
        self.outbox = outbox
        self.counters = counters
        self.queue = PrefillQueue(worker.config.scheduler.max_group_size,
                                  worker.config.slo.ttft_s)  # fmt: skip
        self.jobs: dict[str, EnqueuePrefill] = {}
        # Set by the loop: applies the commands that arrived meanwhile, between two
        # prefills, so a more urgent group queued behind a deep backlog goes next
        # (SLO classes) and a cancel takes effect before its turn.
        self.poll: Callable[[], None] = lambda: None
        # Set by the loop: swaps its decode sequences out to make room for a prompt.
        self.evict: Evict | None = None
        # The front job waits for device KV blocks (retried by the loop shortly).
        self.waiting_for_kv = False
        # handoffs sent, until a new proxy starts: it frees those nobody claimed
        self.handoffs = SentHandoffs()

    def enqueue(self, msg: EnqueuePrefill) -> None:
        if msg.model not in self.worker.specs:
            self._fail(msg.request_id, msg.model, "unknown_model",
                       f"model {msg.model!r} is not served")  # fmt: skip
            return
        request = prefill_request(msg)
        try:
            self.queue.add(request, msg.group_id)
        except ValueError as exc:
            self._fail(msg.request_id, msg.model, "bad_request", str(exc))
            return
        self.jobs[msg.request_id] = msg
        self.worker.metrics.tokens("arrival", msg.model, len(msg.prompt_token_ids))

    def cancel(
        self, request_id: str, free_handoff: bool = False, in_use: Collection[int] = ()
    ) -> bool:
        """Out of the queue (True if it was there); ``free_handoff``: its sent, unclaimed
        handoff is freed too (see ``CancelRequest.free_handoff``), unless its blocks
        are among ``in_use`` (this instance's own sequences hold them now)."""
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

    def run_all(self) -> None:
        """Run every queued prefill job, front group first (Algorithm 1, line 15);
        stop at one whose KV blocks are not free yet (``waiting_for_kv``)."""
        self.waiting_for_kv = False
        while (head := self.queue.peek()) is not None:
            _, request = head
            msg = self.jobs[request.request_id]
            blocks = reserve_blocks(self.worker, msg, self.evict)
            if blocks is None:
                self.waiting_for_kv = True  # it stays queued, at the front
                return
            self.queue.start(request.request_id, self.clock.wall())
            try:
                del self.jobs[request.request_id]
                if isinstance(blocks, PrefillOutcome):
                    outcome = blocks
                else:
                    nxt = next((g.model for g in self.queue if g.model != msg.model), None)
                    outcome = run_prefill(self.worker, msg, blocks, nxt, self.clock)
            finally:
                self.queue.finish(request.request_id)
            if outcome.switch is not None:
                self.counters.note_switch(outcome.switch)
            if isinstance(outcome.message, PrefillDone):
                self.handoffs.record(msg.request_id, outcome.message.handoff)
            self.outbox.send(outcome.message)
            done = isinstance(outcome.message, PrefillDone)
            metrics = self.worker.metrics
            metrics.request_done("prefill", msg.model, "ok" if done else "failed")
            if done:
                metrics.tokens("prefill", msg.model, outcome.num_tokens)
                self.counters.prefills += 1
                self.counters.prefill_tokens += outcome.num_tokens
                self.counters.prefill_s += outcome.compute_s
            else:
                self.counters.failed += 1
            self.poll()

    def _fail(self, request_id: str, model: str, code: str, message: str) -> None:
        self.counters.failed += 1
        self.worker.metrics.request_done("prefill", model, "failed")
        w = self.worker
        self.outbox.send(RequestFailed(request_id, w.kind, w.index, code, message))
