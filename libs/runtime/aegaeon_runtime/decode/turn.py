"""One turn: a batch decoded for its quota (paper §4.3, Alg. 2 lines 10-11; §5.3).

Before the first step the batch's model is switched in and the model the
round controller names (:meth:`~aegaeon_sched.RoundController.prefetch_model`)
prefetched; every request's KV swap-in is launched. Then steps run until the
controller says the turn is over (:meth:`~aegaeon_sched.RoundController.turn_over`:
quota spent, batch emptied, a one-model round cut by a new batch, a hybrid's
prefill waiting): each step decodes the requests whose own KV has arrived
(continuous batching: requests that arrive for the batch mid-turn join at
the next step), streams their tokens and retires the finished ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
from aegaeon_common.messages.report import PrefillDone, SwitchRecord, TokenItem, TurnRecord
from aegaeon_common.messages.structs import RequestTimings, TokenLogprobs
from aegaeon_engine import DecodeSeq
from aegaeon_engine.lora import AdapterWeights
from aegaeon_gpumem import OutOfBlocks
from aegaeon_sched import (
    DecodeBatch,
    DecodeWorkList,
    LatencyModel,
    RoundController,
    TurnEnd,
    load_path_for,
)

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.counters import InstanceCounters
from aegaeon_runtime.decode.admit import Admission
from aegaeon_runtime.decode.residency import KVCapacityError, Residency
from aegaeon_runtime.decode.seq import Seq
from aegaeon_runtime.port import MessageSink, ModelGoneError, WorkerPort
from aegaeon_runtime.sampling import finish_reason, sample_step

KV_POLL_S = 0.0002  # sleep while every request of the turn still waits for its KV


class TurnRunner:
    def __init__(
        self,
        worker: WorkerPort,
        work: DecodeWorkList,
        rounds: RoundController,
        admission: Admission,
        residency: Residency,
        outbox: MessageSink,
        counters: InstanceCounters,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.worker = worker
        self.work = work
        self.rounds = rounds
        self.clock = clock
        self.admission = admission
        self.residency = residency
        self.outbox = outbox
        self.counters = counters
        self.latency: LatencyModel | None = None
        # Drains the instance's inbox between steps (set by the loop that owns it).
        self.poll: Callable[[], None] = lambda: None
        # True when something more urgent waits (a hybrid instance's prefill).
        self.preempt: Callable[[], bool] = lambda: False
        self._following: list[int] = []
        self._turn_steps = 0  # decode steps of the turn in progress
        # Per model, a moving average of a turn's time not spent in decode steps
        # (switch-in, waiting for a prefetch to land, swap-ins, bookkeeping): the
        # switch cost the planner's c should count, which the Eq. 4 estimate
        # (bytes over bandwidth) alone underestimates on a busy host.
        self._overhead_s: dict[str, float] = {}
        config = worker.config
        self.load_path = load_path_for(config.scheduler.policy, config.baseline.load_gb_s,
                                       config.baseline.init_s)  # fmt: skip

    # ---- estimates for the planner ---------------------------------------
    def context_tokens(self, request_id: str) -> int:
        """Prompt plus tokens so far: the context the next step reads."""
        seq = self.admission.seqs.get(request_id)
        return seq.position + 1 if seq is not None else 0

    def switch_estimate(self, model: str) -> float:
        assert self.latency is not None
        return max(self.latency.switch_s(model), self._overhead_s.get(model, 0.0))

    def _charge(self, record: SwitchRecord) -> SwitchRecord:
        """``request-level-charged``: a scale-up takes what the baseline's load path takes
        (``aegaeon_sched.load_path``); what this system's switch left of it is waited out
        here, on the critical path, and recorded (``charged_s``)."""
        if self.load_path is None:
            return record
        nbytes = self.worker.switcher.nbytes(record.to_model)
        owed = self.load_path.charge_s(nbytes, record.total_s)
        if owed > 0:
            self.clock.sleep(owed)
        return msgspec.structs.replace(record, total_s=record.total_s + owed, charged_s=owed)

    def _observe_overhead(self, model: str, seconds: float) -> None:
        old = self._overhead_s.get(model)
        self._overhead_s[model] = seconds if old is None else 0.8 * old + 0.2 * seconds

    # ---- a turn ----------------------------------------------------------
    def _seqs(self, batch: DecodeBatch) -> list[Seq]:
        seqs = self.admission.seqs
        return [seqs[r] for r in batch.requests if r in seqs]

    def _victims(self, batch_id: int) -> Iterator[Seq]:
        """Device-resident requests of other batches, the latest turn first."""
        for other_id in reversed(self._following):
            if other_id == batch_id:
                continue
            other = self.work.batch(other_id)
            if other is None:
                continue
            for seq in self._seqs(other):
                if seq.on_device:
                    yield seq

    def _make_resident(self, batch: DecodeBatch) -> None:
        for seq in self._seqs(batch):
            if seq.on_device or seq.needs_prefill:
                continue
            try:
                self.residency.swap_in(seq, lambda: self._victims(batch.batch_id))
            except KVCapacityError as exc:
                self.admission.fail(seq, "kv_capacity", str(exc))
            except OutOfBlocks:
                return  # the rest waits for room (a later step or turn)

    def run(self, batch: DecodeBatch) -> TurnEnd | None:
        """Decode ``batch``, the controller's turn in progress, until the controller
        says the turn is over; ``None`` when nothing of it can run (no device room)."""
        w, clock, rounds = self.worker, self.clock, self.rounds
        turn = rounds.turn
        assert turn is not None and turn.batch_id == batch.batch_id
        self._following = rounds.following(self.work)
        next_model = rounds.prefetch_model(self.work)
        self.counters.turns += 1
        start_wall, start = clock.wall(), clock.now()
        steps_before, tokens_before = self.counters.steps, self.counters.tokens
        decode_before = self.counters.decode_s
        # Swap-ins first: their copies run on the swap-in stream while the model
        # is switched in (§5.3), instead of after it.
        self._make_resident(batch)
        try:
            record = w.switcher.activate(batch.model)
        except ModelGoneError as exc:
            for seq in self._seqs(batch):
                self.admission.fail(seq, exc.code, exc.message)
            return None
        if record is not None:
            self.counters.note_switch(self._charge(record))
        if next_model is not None:
            w.switcher.prefetch(next_model)
        switch_s = clock.now() - start
        kv_wait_s = 0.0
        rounds.start_quota(clock.now())
        self._turn_steps = 0
        try:
            while True:
                self.poll()
                end = rounds.turn_over(self.work, clock.now(), prefill_waiting=self.preempt())
                if end is not None:
                    return end
                # each pass reads the batch afresh (a prefill or a swap-in may end some)
                seqs = self._seqs(batch)
                if any(s.prompt_token_ids is not None for s in seqs):  # request-level
                    self._prefill_new(batch)
                    seqs = self._seqs(batch)
                if not all(s.on_device or s.prompt_token_ids is not None for s in seqs):
                    self._make_resident(batch)
                    seqs = self._seqs(batch)
                ready = [s for s in seqs if s.ready()]
                if not ready:
                    waiting = [s for s in seqs if s.on_device]
                    if not waiting and not any(s.needs_prefill for s in seqs):
                        return None  # nothing can run this turn (no room)
                    self.admission.tokens.flush()
                    clock.sleep(KV_POLL_S)
                    kv_wait_s += KV_POLL_S
                    for s in waiting:
                        s.kv_wait_s += KV_POLL_S
                    continue
                if not self._step(batch, ready):
                    # No room for any of them: the blocks of the victims just swapped
                    # out come back when their copies complete (the move list).
                    self.admission.tokens.flush()
                    clock.sleep(KV_POLL_S)
                    kv_wait_s += KV_POLL_S
        finally:
            self.admission.tokens.flush()
            busy_s = clock.now() - start - (self.counters.decode_s - decode_before)
            if self.counters.steps > steps_before:  # a turn that decoded nothing says little
                self._observe_overhead(batch.model, busy_s)
            self.counters.note_turn(
                TurnRecord(
                    model=batch.model, batch_id=batch.batch_id, start_s=start_wall,
                    end_s=clock.wall(), quota_s=turn.quota_s, switch_s=switch_s,
                    kv_wait_s=kv_wait_s, steps=self.counters.steps - steps_before,
                    tokens=self.counters.tokens - tokens_before,
                    engine_s=self.counters.decode_s - decode_before,
                )
            )  # fmt: skip

    def _prefill_new(self, batch: DecodeBatch) -> None:
        """Request-level policies: prefill the batch's new requests (prefill-first)."""
        w = self.worker
        for seq in self._seqs(batch):
            if not seq.needs_prefill or seq.prompt_token_ids is None:
                continue
            start = self.clock.wall()
            try:
                blocks = self.residency._alloc(seq, seq.shape.blocks_for(seq.prompt_len + 1),
                                               lambda: self._victims(batch.batch_id))
            except OutOfBlocks:
                return
            seq.device_blocks, seq.on_device, seq.ready_event = blocks, True, None
            if why := self._grammar_problem(seq):
                self.admission.fail(seq, "bad_grammar", why)
                continue
            stepping, adapters = self._adapters(batch, [seq])
            if not stepping:
                continue  # its adapter has no room now, or is gone (failed)
            scored: list[TokenLogprobs] = []
            if seq.index == 0 and seq.params.prompt_logprobs >= 0:
                logits, scored = w.engine.prefill_scored(seq.prompt_token_ids, blocks,
                                                         seq.params.prompt_logprobs,
                                                         adapter=adapters[0])
            else:
                logits = w.engine.prefill(seq.prompt_token_ids, blocks, adapter=adapters[0])
            tokens, logprobs = sample_step(w.sampler, logits[None], [seq.sampling])
            token, lp = tokens[0], [x for x in logprobs if x is not None]
            seq.prompt_token_ids = None
            if why := self._grammar_problem(seq):
                self.admission.fail(seq, "bad_grammar", why)
                continue
            done = self.clock.wall()
            finish = finish_reason(token, 1, seq.params)
            timings = RequestTimings(prefill_wait_s=max(0.0, start - seq.arrival_s),
                                     prefill_s=done - start)  # fmt: skip
            seq.prefill_timings = timings
            seq.joined_s = done
            self.counters.prefills += 1
            w.metrics.tokens("prefill", seq.model, seq.prompt_len)
            w.metrics.request_done("prefill", seq.model, "ok")
            if finish is not None:  # freed first: the message carries what is left
                self.admission.finish(seq)
            if seq.index == 0:
                holdings = self.admission.changed() if finish is not None else None
                self.outbox.send(PrefillDone(seq.request_id, w.index, token, finish, None,
                                             timings, done, w.kind, holdings, logprobs=lp,
                                             prompt_logprobs=scored))  # fmt: skip
            else:  # the request's other sequences: their first tokens as decoded ones
                self.admission.tokens.add([TokenItem(seq.request_id, [token], finish,
                                                     seq.timings(done) if finish else None,
                                                     seq.index, lp)], urgent=True)

    @staticmethod
    def _grammar_problem(seq: Seq) -> str:
        """Why ``seq``'s grammar cannot give its next mask ('' when it can)."""
        grammar = seq.sampling.grammar
        return grammar.check() if grammar is not None else ""

    def _adapters(self, batch: DecodeBatch,
                  stepping: list[Seq]) -> tuple[list[Seq], list[AdapterWeights | None]]:
        """The LoRA adapter of each stepping sequence of an adapter of the batch's model
        (brought to the device now if needed); sequences whose adapter has no room this
        step wait (their blocks stay). An adapter its cachemgr no longer holds fails its
        sequences."""
        model = batch.model
        if all(s.model == model for s in stepping):
            return stepping, [None] * len(stepping)
        names = [None if s.model == model else s.model for s in stepping]
        before = self.worker.adapters.num_loads
        try:
            weights = self.worker.adapters.for_step(names)
        except ModelGoneError as exc:
            for seq in stepping:
                if seq.model == exc.model:
                    self.admission.fail(seq, exc.code, exc.message)
            return self._adapters(batch, [s for s in stepping if s.model != exc.model])
        self.counters.adapter_loads += self.worker.adapters.num_loads - before
        runs = [n is None or a is not None for n, a in zip(names, weights, strict=True)]
        return ([s for s, ok in zip(stepping, runs, strict=True) if ok],
                [a for a, ok in zip(weights, runs, strict=True) if ok])

    def _step(self, batch: DecodeBatch, ready: list[Seq]) -> int:
        """One decode step of the ``ready`` requests that have room; how many stepped."""
        w = self.worker
        stepping: list[Seq] = []
        grow, victims = self.residency.grow, lambda: self._victims(batch.batch_id)
        for seq in ready:
            try:
                grow(seq, victims)
                stepping.append(seq)
            except KVCapacityError as exc:  # it outgrew the whole device region
                self.admission.fail(seq, "kv_capacity", str(exc))
            except OutOfBlocks:
                continue  # waits for room; decoded when blocks free up
        for seq in [s for s in stepping if s.sampling.grammar is not None]:
            if why := self._grammar_problem(seq):
                stepping.remove(seq)
                self.admission.fail(seq, "bad_grammar", why)
        if not stepping:
            return 0
        stepping, adapters = self._adapters(batch, stepping)
        if not stepping:
            return 0
        positions = [s.position for s in stepping]
        start = self.clock.now()
        logits = w.engine.decode(
            [DecodeSeq(s.tokens[-1], p, s.device_blocks, a)
             for s, p, a in zip(stepping, positions, adapters, strict=True)]
        )
        tokens, logprobs = sample_step(w.sampler, logits, [s.sampling for s in stepping])
        seconds = self.clock.now() - start
        now = self.clock.wall()
        items: list[TokenItem] = []
        # the context each stepped token read: its position and the ones before it
        context = sum(positions) + len(positions)
        for seq, token, lp in zip(stepping, tokens, logprobs, strict=True):
            seq.decode_s += seconds
            finish = finish_reason(token, len(seq.tokens), seq.params)
            timings = seq.timings(now) if finish else None
            items.append(TokenItem(seq.request_id, [token], finish, timings, seq.index,
                                   [lp] if lp is not None else []))
            if finish:
                self.admission.finish(seq)
                w.metrics.request_done("decode", seq.model, finish)
        # a turn's first tokens may have waited a round: they leave at once, as
        # do tokens close to their deadlines (aegaeon_runtime.decode.emit)
        emitter = self.admission.tokens
        urgent = self._turn_steps == 0
        if emitter.holds and not urgent:
            due = (s.deadline_s(len(s.tokens) - 1, emitter.slo) for s in stepping)
            urgent = emitter.near_deadlines(due, now, seconds)
        emitter.add(items, urgent=urgent)
        self._turn_steps += 1
        self.counters.steps += 1
        self.counters.tokens += len(stepping)
        for model, count in Counter(s.model for s in stepping).items():  # adapters apart
            w.metrics.tokens("decode", model, count)
        self.counters.decode_s += seconds
        if self.latency is not None:
            self.latency.observe_decode(batch.model, len(stepping), context, seconds)
        return len(stepping)
