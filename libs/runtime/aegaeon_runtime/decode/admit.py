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
from aegaeon_runtime.decode.seq import Seq
from aegaeon_runtime.holdings import Reading, no_reading
from aegaeon_runtime.kv import event_from_spec
from aegaeon_runtime.port import MessageSink, WorkerPort
from aegaeon_runtime.sampling import engine_params, resume_generator


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
        self.seqs: dict[str, Seq] = {}
        self._local_batches: dict[str, int] = {}
        config = worker.config
        slo = SLO(config.slo.ttft_s, config.slo.tbt_s)
        self.tokens = TokenEmitter(outbox, worker.index, slo, config.scheduler.token_hold, clock,
                                   worker.kind)  # fmt: skip
        # the instance's holdings after a request's end (set by the loop; see holdings.py)
        self.changed: Reading = no_reading

    def _add(self, seq: Seq, max_tokens: int, priority: int = 1) -> bool:
        request = Request(seq.request_id, seq.model, seq.arrival_s, seq.prompt_len, max_tokens,
                          priority=priority, ttft_s=seq.ttft_s, tbt_s=seq.tbt_s)  # fmt: skip
        try:
            self.work.add(request, seq.batch_id)
        except ValueError as exc:
            self.fail(seq, "bad_request", str(exc))
            return False
        self.seqs[seq.request_id] = seq
        return True

    def enqueue(self, msg: Message) -> None:
        """A prefilled request joins its batch (Alg. 2 line 2); its KV is in the host cache."""
        assert isinstance(msg, EnqueueDecode)
        w = self.worker
        if msg.model not in w.specs:
            self.refuse(msg.request_id, "unknown_model", f"model {msg.model!r} is not served")
            return
        params = engine_params(msg.sampling)
        spec = w.specs[msg.model]
        seq = Seq(
            request_id=msg.request_id,
            model=msg.model,
            batch_id=msg.batch_id,
            shape=w.kv_shape(msg.model),
            params=params,
            generator=resume_generator(params, w.engine.device, spec.vocab_size,
                                       msg.num_generated),
            prompt_len=msg.prompt_len,
            arrival_s=msg.arrival_s,
            tokens=[msg.first_token_id],
            host_blocks=list(msg.handoff.block_offsets),
            host_event=event_from_spec(msg.handoff.event),
            joined_s=self.clock.wall(),
            ttft_s=msg.ttft_s or None,
            tbt_s=msg.tbt_s or None,
        )  # fmt: skip
        try:
            self.residency.accept(seq)
        except RemoteError as exc:  # the blocks are gone (e.g. the prefill lease ended)
            self.fail(seq, "kv_lost", f"handoff blocks unavailable: {exc}")
            return
        if self._add(seq, msg.sampling.max_tokens, msg.priority):
            w.metrics.tokens("arrival", msg.model, msg.prompt_len)

    def run_request(self, msg: Message) -> None:
        """Request-level policies: the whole request runs here, prefill first."""
        assert isinstance(msg, RunRequest)
        w = self.worker
        if msg.model not in w.specs:
            self.refuse(msg.request_id, "unknown_model", f"model {msg.model!r} is not served")
            return
        batch_id = self._local_batches.setdefault(msg.model, -1 - len(self._local_batches))
        params = engine_params(msg.sampling)
        seq = Seq(
            request_id=msg.request_id,
            model=msg.model,
            batch_id=batch_id,
            shape=w.kv_shape(msg.model),
            params=params,
            generator=params.make_generator(w.engine.device),
            prompt_len=len(msg.prompt_token_ids),
            arrival_s=msg.arrival_s,
            tokens=[],
            prompt_token_ids=list(msg.prompt_token_ids),
            joined_s=self.clock.wall(),
        )
        if self._add(seq, msg.sampling.max_tokens):
            w.metrics.tokens("arrival", msg.model, len(msg.prompt_token_ids))

    def host_blocks_in_use(self) -> set[int]:
        """The unified KV cache blocks this instance's sequences hold (swapped out, or a
        handoff not yet swapped in)."""
        return {offset for seq in self.seqs.values() for offset in seq.host_blocks}

    def cancel(self, msg: Message) -> None:
        assert isinstance(msg, CancelRequest)
        seq = self.seqs.get(msg.request_id)
        if seq is not None:
            self.finish(seq)
            self.counters.cancelled += 1
            self.worker.metrics.request_done("decode", seq.model, "cancelled")

    def drop_all(self) -> int:
        """Forget every request and free its KV (a new proxy started: the old one's
        requests have no client left). Returns how many."""
        seqs = list(self.seqs.values())
        for seq in seqs:
            self.finish(seq)
            self.counters.cancelled += 1
            self.worker.metrics.request_done("decode", seq.model, "cancelled")
        return len(seqs)

    def finish(self, seq: Seq) -> None:
        """Forget ``seq`` and free its KV (finished, cancelled or failed)."""
        self.residency.release(seq)
        self.work.remove(seq.request_id)
        self.seqs.pop(seq.request_id, None)

    def fail(self, seq: Seq, code: str, message: str) -> None:
        self.finish(seq)
        self.refuse(seq.request_id, code, message, seq.model)

    def refuse(self, request_id: str, code: str, message: str, model: str = "unknown") -> None:
        self.counters.failed += 1
        w = self.worker
        w.metrics.request_done("decode", model, "failed")
        self.tokens.flush()  # what a request got before its failure arrives first
        self.outbox.send(RequestFailed(request_id, w.kind, w.index, code, message,
                                       self.changed()))  # fmt: skip
