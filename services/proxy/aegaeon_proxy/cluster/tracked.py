"""A request as the backend tracks it between instances."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import msgspec
from aegaeon_common.messages.decode import EnqueueDecode, RunRequest
from aegaeon_common.messages.prefill import EnqueuePrefill
from aegaeon_common.messages.structs import KVHandoff, RequestTimings, TokenLogprobs
from aegaeon_sched import Request

from aegaeon_proxy.backend import FinishReason, GenerationRequest, TokenChunk, TokenQueue


@dataclass
class Tracked:
    gen: GenerationRequest
    sched: Request
    queue: TokenQueue
    num_generated: int = 0
    first_token_id: int | None = None
    handoff: KVHandoff | None = None
    prefill_timings: RequestTimings | None = None
    retries: int = 0  # dispatched again after its instance failed before its first token
    handoff_owner: str | None = None  # the instance (kind-index) that leased the handoff
    deferred: bool = False  # waiting in the proxy for admission room (SLO class shedding)
    # n > 1: every sequence's first token and those that ended with it; the sequences
    # still generating (the request ends when none is)
    first_token_ids: list[int] = field(default_factory=list)
    finished_first: list[int] = field(default_factory=list)
    open_seqs: set[int] = field(default_factory=set)
    where: Where | None = None  # the instance that holds it now (None: none yet)
    tokens_written: int = 0  # num_generated as its metadata in the store last says

    def __post_init__(self) -> None:
        self.open_seqs = set(range(self.gen.sampling.n))

    # ---- the work messages for its instances (one node or many: ``incarnation``, the
    # process it is for; ``reply_to``, the replica that holds its client)
    def prefill_message(self, incarnation: int, reply_to: str, group_id: int,
                        group_key_s: float | None) -> EnqueuePrefill:  # fmt: skip
        gen, sched = self.gen, self.sched
        return EnqueuePrefill(gen.request_id, gen.model, group_id, list(gen.prompt_token_ids),
                              gen.sampling, gen.arrival_s, incarnation=incarnation,
                              reply_to=reply_to, priority=sched.priority,
                              ttft_s=sched.ttft_s or 0.0, tbt_s=sched.tbt_s or 0.0,
                              group_key_s=group_key_s)  # fmt: skip

    def decode_message(self, incarnation: int, reply_to: str,
                       batch_id: int) -> EnqueueDecode | None:  # fmt: skip
        """None before its first token and handoff."""
        gen, sched = self.gen, self.sched
        if self.handoff is None or self.first_token_id is None:
            return None
        # beyond one sequence's first token: the other sequences' and, for a
        # repetition penalty, the prompt
        prompt = list(gen.prompt_token_ids) if gen.sampling.repetition_penalty != 1.0 else []
        return EnqueueDecode(
            request_id=gen.request_id, model=gen.model, batch_id=batch_id,
            prompt_len=len(gen.prompt_token_ids), first_token_id=self.first_token_id,
            num_generated=self.num_generated, sampling=gen.sampling, handoff=self.handoff,
            arrival_s=gen.arrival_s, incarnation=incarnation, reply_to=reply_to,
            priority=sched.priority, ttft_s=sched.ttft_s or 0.0, tbt_s=sched.tbt_s or 0.0,
            first_token_ids=self.first_token_ids, finished=self.finished_first,
            prompt_token_ids=prompt,
        )  # fmt: skip

    def run_message(self, incarnation: int, reply_to: str) -> RunRequest:
        gen = self.gen
        return RunRequest(gen.request_id, gen.model, list(gen.prompt_token_ids), gen.sampling,
                          gen.arrival_s, incarnation=incarnation, reply_to=reply_to)  # fmt: skip


@dataclass
class Where:
    """Where a request sits: an instance (one process of it) and the store key of what
    placed it there."""

    instance: str
    incarnation: int
    node: str
    queue: str  # that instance's prefill queue or decode work list ("" for a baseline: none)
    stage: str  # "prefill" | "decode" | "run" (a baseline's unified instance)


def merge_timings(
    prefill: RequestTimings | None, decode: RequestTimings | None
) -> RequestTimings:
    """One request's breakdown: a decode instance never sees the prefill's part (a
    unified instance reports both, in ``decode``)."""
    if decode is None:
        return prefill or RequestTimings()
    if prefill is None or decode.prefill_s > 0:
        return decode
    return msgspec.structs.replace(
        decode, prefill_wait_s=prefill.prefill_wait_s, prefill_s=prefill.prefill_s,
        kv_control_s=prefill.kv_control_s + decode.kv_control_s,
        extra={**prefill.extra, **decode.extra},
    )  # fmt: skip


def deliver(
    tracked: Tracked, token_ids: Sequence[int], reason: str | None,
    timings: RequestTimings | None = None, *, index: int = 0,
    logprobs: Sequence[TokenLogprobs] = (), prompt_logprobs: Sequence[TokenLogprobs] | None = None,
) -> bool:
    """Push sequence ``index``'s ``token_ids`` to the request's stream as one chunk (as
    the instance grouped them); when that ends the request (no sequence left open) it
    finishes the stream, with where its time went. True when the request ended."""
    if reason is not None:
        tracked.open_seqs.discard(index)
    ended = reason is not None and not tracked.open_seqs
    final = None
    if ended and (tracked.prefill_timings is not None or timings is not None):
        final = merge_timings(tracked.prefill_timings, timings)
    tracked.queue.push(TokenChunk(
        tuple(token_ids), cast(FinishReason | None, reason if ended else None), timings=final,
        index=index, seq_finish=reason, logprobs=tuple(logprobs),
        prompt_logprobs=None if prompt_logprobs is None else tuple(prompt_logprobs),
    ))  # fmt: skip
    return ended

