"""A request as the distributed backend tracks it between instances."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from aegaeon_common.messages.structs import KVHandoff, RequestTimings, SamplingSpec
from aegaeon_sched import Request

from aegaeon_proxy.backend import GenerationRequest, TokenQueue

MAX_TIMING_RECORDS = 20000


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


@dataclass(frozen=True)
class TimingRecord:
    """Where one finished request's time went (for the Fig. 14 breakdown)."""

    request_id: str
    model: str
    arrival_s: float
    finish_reason: str
    num_tokens: int
    timings: RequestTimings


@dataclass
class TimingLog:
    records: deque[TimingRecord] = field(default_factory=lambda: deque(maxlen=MAX_TIMING_RECORDS))

    def add(self, tracked: Tracked, reason: str, timings: RequestTimings | None) -> None:
        t = timings or tracked.prefill_timings or RequestTimings()
        self.records.append(
            TimingRecord(
                tracked.gen.request_id, tracked.gen.model, tracked.gen.arrival_s, reason,
                tracked.num_generated, t,
            )
        )  # fmt: skip
