"""A request as the distributed backend tracks it between instances."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from aegaeon_common.messages.structs import KVHandoff, RequestTimings, SamplingSpec
from aegaeon_sched import Request

from aegaeon_proxy.backend import GenerationRequest, TokenQueue


@dataclass
class Tracked:
    gen: GenerationRequest
    sched: Request
    sampling: SamplingSpec
    queue: TokenQueue
    instance: str | None = None  # where it is now (policy InstanceId)
    num_generated: int = 0
    first_token_id: int | None = None
    handoff: KVHandoff | None = None
    prefill_timings: RequestTimings | None = None
    retries: int = 0  # dispatched again after its instance failed before its first token
    handoff_owner: str | None = None  # the instance whose lease holds the handoff's blocks
    deferred: bool = False  # waiting in the proxy for admission room (SLO class shedding)


@dataclass(frozen=True)
class TimingRecord:
    """Where one finished request's time went (for the Fig. 14 breakdown)."""

    request_id: str
    model: str
    arrival_s: float
    finish_reason: str
    num_tokens: int
    timings: RequestTimings


def merge_timings(
    prefill: RequestTimings | None, decode: RequestTimings | None
) -> RequestTimings:
    """One request's breakdown: the prefill instance's part and the decode's part.

    A unified instance (request-level policies) reports both parts itself, in
    ``decode``; a decode instance never sees the prefill's, so they are merged here.
    """
    if decode is None:
        return prefill or RequestTimings()
    if prefill is None or decode.prefill_s > 0:
        return decode
    return RequestTimings(
        prefill_wait_s=prefill.prefill_wait_s,
        prefill_s=prefill.prefill_s,
        decode_wait_s=decode.decode_wait_s,
        decode_s=decode.decode_s,
        kv_wait_s=decode.kv_wait_s,
        kv_control_s=prefill.kv_control_s + decode.kv_control_s,
        extra={**prefill.extra, **decode.extra},
    )


@dataclass
class TimingLog:
    max_records: int = 2000  # proxy.stats_records
    records: deque[TimingRecord] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.records = deque(self.records, maxlen=self.max_records)

    def add(self, tracked: Tracked, reason: str, timings: RequestTimings | None) -> None:
        t = merge_timings(tracked.prefill_timings, timings)
        self.records.append(
            TimingRecord(
                tracked.gen.request_id, tracked.gen.model, tracked.gen.arrival_s, reason,
                tracked.num_generated, t,
            )
        )  # fmt: skip
