"""A decode instance's compute loop: rounds of turns (paper §4.3, Algorithm 2).

The instance mirrors its work list of per-model batches with the proxy's
:class:`~aegaeon_sched.DecodeWorkList` (same ``add(request, batch)`` calls).
Its :class:`~aegaeon_sched.RoundController` (the one the simulator's decode
instance runs) plans each round (same-model batches adjacent, Eq. 2-3
quotas), names each turn, ends it and cuts the round; each turn switches the
batch's model in (prefetching the model the controller names behind it),
swaps its requests' KV in, and decodes it with continuous batching,
streaming tokens every step. Requests join as soon as their own KV has
arrived.

Under request-level policies the same loop serves ``RunRequest``: the
request is prefilled here first and its batch holds the instance's only
model (the policy gives an instance one model at a time).

A hybrid instance (a prefill instance decoding when idle) runs the prefill loop
(:class:`~aegaeon_runtime.prefill.loop.PrefillLoop`) first, at every decode step
boundary, and plans its rounds for the share of its time its prefills leave
(:class:`~aegaeon_sched.DecodeShare`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.decode import EnqueueDecode, RunRequest
from aegaeon_common.messages.prefill import (
    AckDrain,
    AddModel,
    CancelRequest,
    EnqueuePrefill,
    ProxyStarted,
    SetModelAwake,
    Shutdown,
)
from aegaeon_common.messages.report import InstanceStats
from aegaeon_common.wire import Message
from aegaeon_sched import (
    DecodeShare,
    DecodeWorkList,
    LatencyModel,
    RoundController,
    RoundRobinPlanner,
)

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.counters import InstanceCounters
from aegaeon_runtime.decode.admit import Admission
from aegaeon_runtime.decode.residency import Residency
from aegaeon_runtime.decode.turn import TurnRunner
from aegaeon_runtime.holdings import HoldingsBook, used_blocks
from aegaeon_runtime.instance import InstanceLoop
from aegaeon_runtime.metrics import InstanceLoad
from aegaeon_runtime.models import set_awake
from aegaeon_runtime.port import MessageSink, MessageSource, WorkerPort
from aegaeon_runtime.prefill.loop import PrefillLoop
from aegaeon_runtime.profile_cache import start_up_profile

log = get_logger("decode")
IDLE_WAIT_S = 0.05
# A hybrid's prefill waiting for device KV blocks (copies in flight) is tried again
# this often; the wait is the inbox's, so commands (a cancel) are served meanwhile.
KV_RETRY_S = 0.005


class DecodeLoop(InstanceLoop):
    """Runs on the compute thread; see the module docstring.

    ``clock``, ``rounds`` and ``profile`` (the latency model's source; default:
    the worker's cached start-up profile) are for tests.
    """

    def __init__(
        self,
        worker: WorkerPort,
        inbox: MessageSource,
        outbox: MessageSink,
        hybrid: bool = False,
        *,
        clock: Clock = SYSTEM_CLOCK,
        rounds: RoundController | None = None,
        profile: Callable[[], LatencyModel] | None = None,
    ) -> None:
        super().__init__(worker, inbox, outbox, clock)
        config = worker.config
        self.work = DecodeWorkList()
        # Eq. 2-3 plus the round bound (rounds within 0.7 x TTFT; see aegaeon_sched.quota);
        # a hybrid's prefills take part of its time: rounds are planned for the rest.
        planner = RoundRobinPlanner(
            config.slo.tbt_s,
            config.scheduler.q_max_s,
            ttft_s=config.slo.ttft_s,
            round_ttft_fraction=config.scheduler.round_ttft_fraction,
        )
        self.rounds = rounds or RoundController(planner, share=DecodeShare() if hybrid else None)
        self.counters = InstanceCounters(metrics=worker.metrics)
        self.residency = Residency(worker, clock)
        self.admission = Admission(worker, self.work, self.residency, outbox, self.counters, clock)
        self.turns = TurnRunner(
            worker, self.work, self.rounds, self.admission, self.residency, outbox,
            self.counters, clock,
        )  # fmt: skip
        # A hybrid instance (a prefill instance decoding when idle) runs prefills first.
        self.prefill = (PrefillLoop(worker, inbox, outbox, counters=self.counters, clock=clock)
                        if hybrid else None)  # fmt: skip
        if self.prefill is not None:
            self.turns.preempt = self.prefill.pending
            self.prefill.evict = self._evict_for_prefill
        self._profile = profile or start_up_profile(worker)
        # what it holds, read into each message that ends a request (its prefills' too)
        self.holdings = HoldingsBook(
            lambda: used_blocks(worker.kv.pool),
            lambda: self.load.prefill_requests + self.load.decode_requests,
        )
        self.admission.changed = self.admission.tokens.changed = self._changed
        if self.prefill is not None:
            self.prefill.changed = self._changed
        self._handlers = {
            EnqueueDecode: self._on_enqueue_decode,
            RunRequest: self.admission.run_request,
            CancelRequest: self._on_cancel,
            EnqueuePrefill: self._on_enqueue_prefill,
            Shutdown: self._on_shutdown,
            AckDrain: self.drain.on_ack,
            AddModel: self._on_add_model,
            ProxyStarted: self._on_proxy_started,
            SetModelAwake: self._on_set_awake,
        }

    def _on_cancel(self, msg: Message) -> None:
        assert isinstance(msg, CancelRequest)
        if self.prefill is not None:
            # a handoff this instance claimed itself belongs to its sequence: the
            # sequence's end frees it (and no block a sequence holds is freed here)
            free = msg.free_handoff and msg.request_id not in self.admission.families
            in_use = self.admission.host_blocks_in_use() if free else ()
            if self.prefill.cancel(msg.request_id, free, in_use):
                return
        self.admission.cancel(msg)

    def _on_enqueue_decode(self, msg: Message) -> None:
        assert isinstance(msg, EnqueueDecode)
        if self.prefill is not None:  # decoding what it prefilled: the handoff is claimed
            self.prefill.handoffs.forget(msg.request_id)
        self.admission.enqueue(msg)

    def _on_enqueue_prefill(self, msg: Message) -> None:
        assert isinstance(msg, EnqueuePrefill)
        if self.prefill is None:
            self.admission.refuse(msg.request_id, "bad_request", "not a prefill instance")
            return
        self.prefill.enqueue(msg)

    def _on_proxy_started(self, msg: Message) -> None:
        """A new proxy (it sends this before any work): every request held here and
        every handoff sent from here are an old proxy's, which died with their
        clients; nobody would end or claim them. Drop them and free their KV."""
        if not self._new_proxy(msg):
            return
        queued = self.prefill.drop_all() if self.prefill is not None else 0
        dropped = self.admission.drop_all()
        freed = (self.prefill.handoffs.free_unclaimed(self.worker.cache)
                 if self.prefill is not None else 0)  # fmt: skip
        if queued or dropped or freed:
            log.info("old_proxy_work_dropped", queued=queued, sequences=dropped,
                     handoffs_freed=freed)  # fmt: skip

    def _on_set_awake(self, msg: Message) -> None:
        """Sleep or wake a model here (applied between two steps: a batch of it in the
        work list, which a turn in progress has, keeps it on the device)."""
        assert isinstance(msg, SetModelAwake)

        def busy(name: str) -> bool:
            queued = self.prefill is not None and self.prefill.has_model(name)
            return queued or any(batch.model == name for batch in self.work)

        idle = not len(self.work) and not self._pending_prefill()
        self.outbox.send(set_awake(self.worker, msg, busy, idle))

    def run(self, stop: threading.Event) -> None:
        self.latency = self.turns.latency = self._profile()
        self.ready.set()
        self.turns.poll = self._poll
        if self.prefill is not None:
            self.prefill.poll = self.turns.poll
        while not (stop.is_set() or self._stop.is_set()):
            busy = len(self.work) or self._pending_prefill()
            if self._prefill_waits_for_kv():
                self.apply(self.inbox.wait(KV_RETRY_S))
            else:
                self.apply(self.inbox.drain() if busy else self.inbox.wait(IDLE_WAIT_S))
            self._publish_load()
            self.snapshots.offer(self._queue_states)
            if self.prefill is not None:
                self.prefill.run_all()
                if self._prefill_waits_for_kv():
                    continue  # no decoding meanwhile: its swap-ins would take the blocks
            if not len(self.work):
                if self.drain.done(idle=not self._pending_prefill()):
                    self.admission.tokens.flush()
                    return  # drained: every request finished, nothing more comes
                continue
            self.run_round(stop)
            self._publish_load()

    def _poll(self) -> None:
        """Between two steps: the commands that came, and a snapshot if one is wanted."""
        self.apply(self.inbox.drain())
        self.snapshots.offer(self._queue_states)

    def _queue_states(self) -> tuple[bytes | None, bytes]:
        """The stored form of its queues (a copy for the registrar: shared_queues)."""
        queue = self.prefill.queue if self.prefill is not None else None
        encode = msgspec.msgpack.encode
        return (encode(queue) if queue is not None else None, encode(self.work))

    def _prefill_waits_for_kv(self) -> bool:
        return self.prefill is not None and self.prefill.waiting_for_kv and self.prefill.pending()

    def _evict_for_prefill(self, num_bytes: int) -> int:
        """Room for a hybrid's prompt: its decode sequences go to the host cache,
        the latest to join first (they come back at their batches' next turns)."""
        victims = [s for s in reversed(self.admission.seqs.values()) if s.on_device]
        return self.residency.make_room(num_bytes, victims)

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
        """Plan a round and run its turns until the controller ends it (all turns
        run, or cut: a hybrid's prefill waits, a batch the round did not plan for)."""
        assert self.latency is not None
        prefill_s = self.counters.prefill_s if self.prefill is not None else 0.0
        self.rounds.plan_round(
            self.work, self.latency, self.turns.context_tokens, self.turns.switch_estimate,
            now_s=self.clock.now(), prefill_busy_s=prefill_s,
        )  # fmt: skip
        self.counters.rounds += 1
        while not (stop.is_set() or self._stop.is_set()):
            turn = self.rounds.next_turn(self.work, prefill_waiting=self._pending_prefill())
            if turn is None:
                return
            batch = self.work.batch(turn.batch_id)
            assert batch is not None  # the controller skips emptied batches
            self.turns.run(batch)

    def stats(self) -> InstanceStats:
        return self.counters.snapshot(self.worker)

