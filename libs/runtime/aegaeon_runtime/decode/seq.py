"""A request on a decode instance: its tokens, sampling state and where its KV is.

KV residency (paper §5.3):

- ``host``: the KV is in the unified CPU cache (``host_blocks``); the copy that
  put it there may still run (``host_event``, the producer's swap-out).
- ``device``: the KV is in this instance's device region (``device_blocks``);
  the swap-in copy may still run (``ready_event``): the request joins
  decoding as soon as its own event completes (rule 1), not the batch's.
- ``prefill``: request-level policies only: no KV yet, the prompt must be
  prefilled here first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aegaeon_common.messages.structs import RequestTimings
from aegaeon_engine import KVShape, SamplingParams
from aegaeon_gpumem import Event
from aegaeon_sched import SLO

from aegaeon_runtime.sampling import SeqSampling


@dataclass
class SharedHost:
    """Host blocks several sequences of one request read (its ``n`` sequences share the
    prompt's handoff): freed once the last of them has swapped in or ended."""

    holders: int
    last_read: Event | None = None  # the latest copy that reads them (a swap-in's)


@dataclass
class Seq:
    request_id: str
    model: str
    batch_id: int
    shape: KVShape
    sampling: SeqSampling  # its parameters, generator, tokens so far (``tokens``), grammar
    prompt_len: int
    arrival_s: float
    tokens: list[int]  # generated so far (the prefill's first token included)
    prompt_token_ids: list[int] | None = None  # request-level: prefill here
    index: int = 0  # which of the request's n sequences
    host_blocks: list[int] = field(default_factory=list)
    host_shared: SharedHost | None = None  # host_blocks are the request's shared handoff
    host_event: Event | None = None
    device_blocks: list[int] = field(default_factory=list)
    ready_event: Event | None = None
    on_device: bool = False
    joined_s: float = 0.0  # wall clock: when it joined this instance
    prefill_timings: RequestTimings | None = None
    decode_s: float = 0.0
    kv_wait_s: float = 0.0
    kv_control_s: float = 0.0  # its swaps' bookkeeping here (paper Fig. 14: control overhead)
    num_swaps: int = 0
    ttft_s: float | None = None  # its own targets (SLO class); None: the deployment's
    tbt_s: float | None = None

    @property
    def key(self) -> str:
        """Its id on this instance (the work list's): the request's, ``/i`` for sequence
        i > 0 of an ``n`` > 1 request."""
        return self.request_id if self.index == 0 else f"{self.request_id}/{self.index}"

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    def deadline_s(self, k: int, default: SLO) -> float:
        """When its token ``k`` (0: the first) is due: ``arrival + TTFT + k x TBT``."""
        ttft = default.ttft_s if self.ttft_s is None else self.ttft_s
        tbt = default.tbt_s if self.tbt_s is None else self.tbt_s
        return self.arrival_s + ttft + k * tbt

    @property
    def needs_prefill(self) -> bool:
        return self.prompt_token_ids is not None

    @property
    def position(self) -> int:
        """Position of the newest token, the one the next decode step feeds."""
        return self.prompt_len + len(self.tokens) - 1

    @property
    def num_tokens_in_kv(self) -> int:
        """Positions whose K/V exist (the newest token's are written by the next step)."""
        return self.position

    def blocks_needed(self) -> int:
        """Device blocks the next step needs (its write goes to ``position``)."""
        return self.shape.blocks_for(self.prompt_len + len(self.tokens))  # position + 1

    def ready(self) -> bool:
        """On device with its swap-in complete (rule 1 of §5.3), its grammar's matcher
        made."""
        grammar = self.sampling.grammar  # SeqSampling.ready inlined: a call less per step
        if not self.on_device or (grammar is not None and not grammar.ready()):
            return False
        if self.ready_event is not None:
            if not self.ready_event.query():
                return False
            self.ready_event = None
        return True

    def timings(self, now_s: float) -> RequestTimings:
        base = self.prefill_timings or RequestTimings()
        total = max(0.0, now_s - self.joined_s)
        return RequestTimings(
            prefill_wait_s=base.prefill_wait_s,
            prefill_s=base.prefill_s,
            decode_wait_s=max(0.0, total - self.decode_s - self.kv_wait_s),
            decode_s=self.decode_s,
            kv_wait_s=self.kv_wait_s,
            kv_control_s=base.kv_control_s + self.kv_control_s,
            extra={**base.extra, "swaps": float(self.num_swaps)},
        )
