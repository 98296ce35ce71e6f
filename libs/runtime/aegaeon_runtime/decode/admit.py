"""Requests entering and leaving a decode instance (commands from the proxy)."""

from __future__ import annotations

from aegaeon_common.messages.decode import EnqueueDecode, RunRequest
from aegaeon_common.messages.prefill import CancelRequest
from aegaeon_common.messages.report import RequestFailed
from aegaeon_common.transport import RemoteError
from aegaeon_common.wire import Message
from aegaeon_sched import SLO, DecodeWorkList, Request

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.counters import InstanceCounters
from aegaeon_runtime.decode.emit import TokenEmitter
from aegaeon_runtime.decode.residency import Residency
from aegaeon_runtime.decode.seq import Seq, SharedHost
from aegaeon_runtime.holdings import Reading, no_reading
from aegaeon_runtime.kv import event_from_spec
from aegaeon_runtime.port import MessageSink, WorkerPort
from aegaeon_runtime.sampling import SeqSampling


class Admission:
    """Owns the instance's requests: ``seqs`` and the work-list mirror."""

    def __init__(
        self,
        worker: WorkerPort,
        work: DecodeWorkList,
        residency: Residency,
        outbox: MessageSink,
        counters: InstanceCounters,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.worker = worker
        self.clock = clock
        self.work = work
        self.residency = residency
        self.outbox = outbox
        self.counters = counters
        self.seqs: dict[str, Seq] = {}  # by Seq.key
        self.families: dict[str, list[str]] = {}  # request id -> its sequences' keys
        self._local_batches: dict[str, int] = {}
        config = worker.config
        slo = SLO(config.slo.ttft_s, config.slo.tbt_s)
        self.tokens = TokenEmitter(outbox, worker.index, slo, config.scheduler.token_hold, clock,
                                   worker.kind)  # fmt: skip
        # the instance's holdings after a request's end (set by the loop; see holdings.py)
        self.changed: Reading = no_reading

    def _add(self, seq: Seq, max_tokens: int, priority: int = 1) -> bool:
        unit = self.worker.unit_of(seq.model)
        request = Request(seq.key, seq.model, seq.arrival_s, seq.prompt_len, max_tokens,
                          priority=priority, ttft_s=seq.ttft_s, tbt_s=seq.tbt_s,
                          unit="" if unit == seq.model else unit)  # fmt: skip
        try:
            self.work.add(request, seq.batch_id)
        except ValueError as exc:
            self.fail(seq, "bad_request", str(exc))
            return False
        self.seqs[seq.key] = seq
        self.families.setdefault(seq.request_id, []).append(seq.key)
        return True

    def _seq(self, msg: EnqueueDecode | RunRequest, index: int, batch_id: int,
             tokens: list[int], prompt_len: int) -> Seq:
        """Sequence ``index`` of ``msg``'s request, joining now with ``tokens`` (its
        sampling state reads the same list)."""
        w = self.worker
        sampling = SeqSampling.start(msg.sampling, index, model=msg.model,
                                     device=w.engine.device, grammars=w.grammars,
                                     prompt_ids=msg.prompt_token_ids, output_ids=tokens)
        return Seq(msg.request_id, msg.model, batch_id, w.kv_shape(msg.model), sampling,
                   prompt_len, msg.arrival_s, tokens, index=index, joined_s=self.clock.wall())

    def enqueue(self, msg: Message) -> None:
        """A prefilled request joins its batch (Alg. 2 line 2); its KV is in the host cache.
        Its ``n`` sequences (those not finished with their first token) share that KV:
        each swaps it in on its own, the last one frees it."""
        assert isinstance(msg, EnqueueDecode)
        w = self.worker
        if msg.model not in w.specs:
            self.refuse(msg.request_id, "unknown_model", f"model {msg.model!r} is not served")
            return
        firsts = list(msg.first_token_ids) or [msg.first_token_id]
        live = [i for i in range(len(firsts)) if i not in set(msg.finished)]
        shared = SharedHost(len(live)) if len(live) > 1 else None
        seqs: list[Seq] = []
        for i in live:
            seq = self._seq(msg, i, msg.batch_id, [firsts[i]], msg.prompt_len)
            seq.host_blocks, seq.host_shared = list(msg.handoff.block_offsets), shared
            seq.host_event = event_from_spec(msg.handoff.event)
            seq.ttft_s, seq.tbt_s = msg.ttft_s or None, msg.tbt_s or None
            seqs.append(seq)
        if not seqs:
            return
        try:
            self.residency.accept(seqs[0])
        except RemoteError as exc:  # the blocks are gone (e.g. the prefill lease ended)
            for seq in seqs:
                seq.host_blocks, seq.host_shared = [], None
                self.fail(seq, "kv_lost", f"handoff blocks unavailable: {exc}")
            return
        for seq in seqs:
            if self._add(seq, msg.sampling.max_tokens, msg.priority):
                w.metrics.tokens("arrival", msg.model, msg.prompt_len)

    def run_request(self, msg: Message) -> None:
        """Request-level policies: the whole request runs here, prefill first (each of
        its ``n`` sequences prefills the prompt on its own)."""
        assert isinstance(msg, RunRequest)
        w = self.worker
        if msg.model not in w.specs:
            self.refuse(msg.request_id, "unknown_model", f"model {msg.model!r} is not served")
            return
        unit = w.unit_of(msg.model)  # a base and its adapters: one batch
        batch_id = self._local_batches.setdefault(unit, -1 - len(self._local_batches))
        for i in range(msg.sampling.n):
            seq = self._seq(msg, i, batch_id, [], len(msg.prompt_token_ids))
            seq.prompt_token_ids = list(msg.prompt_token_ids)  # prefilled here first
            if self._add(seq, msg.sampling.max_tokens):
                w.metrics.tokens("arrival", msg.model, len(msg.prompt_token_ids))

    def host_blocks_in_use(self) -> set[int]:
        """The unified KV cache blocks this instance's sequences hold (swapped out, or a
        handoff not yet swapped in)."""
        return {offset for seq in self.seqs.values() for offset in seq.host_blocks}

    def cancel(self, msg: Message) -> None:
        assert isinstance(msg, CancelRequest)
        family = (self.seqs.get(key) for key in list(self.families.get(msg.request_id, ())))
        self._cancel([seq for seq in family if seq is not None])

    def drop_all(self) -> int:
        """Forget every request and free its KV (a new proxy started: the old one's
        requests have no client left). Returns how many."""
        return self._cancel(list(self.seqs.values()))

    def _cancel(self, seqs: list[Seq]) -> int:
        for seq in seqs:
            self.finish(seq)
            self.counters.cancelled += 1
            self.worker.metrics.request_done("decode", seq.model, "cancelled")
        return len(seqs)

    def finish(self, seq: Seq) -> None:
        """Forget ``seq`` and free its KV (finished, cancelled or failed)."""
        self.residency.release(seq)
        self.work.remove(seq.key)
        self.seqs.pop(seq.key, None)
        family = self.families.get(seq.request_id)
        if family is not None and seq.key in family:
            family.remove(seq.key)
            if not family:
                del self.families[seq.request_id]

    def fail(self, seq: Seq, code: str, message: str) -> None:
        """``seq`` cannot go on: the whole request fails (its other sequences end too)."""
        self.finish(seq)
        for key in list(self.families.get(seq.request_id, ())):
            sibling = self.seqs.get(key)
            if sibling is not None:
                self.finish(sibling)
        self.refuse(seq.request_id, code, message, seq.model)

    def refuse(self, request_id: str, code: str, message: str, model: str = "unknown") -> None:
        self.counters.failed += 1
        w = self.worker
        w.metrics.request_done("decode", model, "failed")
        self.tokens.flush()  # what a request got before its failure arrives first
        self.outbox.send(RequestFailed(request_id, w.kind, w.index, code, message,
                                       self.changed()))  # fmt: skip
