"""Instances -> proxy (PUSH/PULL): tokens, handoffs, failures, liveness and stats."""

from __future__ import annotations

import msgspec

from aegaeon_common.messages.structs import (
    Holdings,
    KVHandoff,
    LatencyProfile,
    RequestTimings,
    TokenLogprobs,
)
from aegaeon_common.wire import Channel, Message, Struct


class InstanceHello(Message, frozen=True):
    """Sent once when an instance is ready (and again after a restart)."""

    TAG = "hello"
    kind: str  # "prefill" | "decode"
    index: int
    pid: int
    kv_capacity_bytes: int  # device KV region
    weights_capacity_bytes: int
    max_batch_size: int
    # Device KV capacity in tokens of each model's KV shape (decode placement).
    capacity_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # The instance's fitted latency model, from its start-up profile; None until
    # profiled.
    latency: LatencyProfile | None = None
    # Random per process (pids repeat: PID 1 in every container): the proxy tells a
    # restarted instance by it, and stamps work for this process with it.
    incarnation: int = 0


class PrefillDone(Message, frozen=True):
    """First token of a request, with its KV handoff (None when it already finished)."""

    TAG = "prefill_done"
    request_id: str
    index: int  # prefill instance
    token_id: int
    finish_reason: str | None
    handoff: KVHandoff | None
    timings: RequestTimings
    emitted_s: float
    kind: str = "prefill"  # the instance's kind: a decode instance prefills too (role switching)
    holdings: Holdings | None = None  # the instance's, once this request left its queue
    # n > 1: the other sequences' first tokens and finish reasons (sequence 1, 2, ...)
    sibling_token_ids: list[int] = msgspec.field(default_factory=list)
    sibling_finish_reasons: list[str | None] = msgspec.field(default_factory=list)
    # with `logprobs`: each sequence's first token's (sequence 0 first)
    logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)
    # with `prompt_logprobs`: prompt tokens 1.. (the first has none)
    prompt_logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)


class TokenItem(Struct, frozen=True):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    timings: RequestTimings | None = None  # with the last item of a request
    index: int = 0  # which of the request's n sequences
    logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)  # one per token


class StepTokens(Message, frozen=True):
    """Tokens of one decode step (or several) of a batch."""

    TAG = "step_tokens"
    index: int  # decode instance
    items: list[TokenItem]
    emitted_s: float
    kind: str = "decode"  # the instance's kind: a prefill instance decodes when idle
    holdings: Holdings | None = None  # the instance's, when a request ended in this message


class RequestFailed(Message, frozen=True):
    TAG = "request_failed"
    request_id: str
    kind: str
    index: int
    code: str
    message: str
    holdings: Holdings | None = None  # the instance's, the request's KV freed


class SwitchRecord(Struct, frozen=True):
    """One model switch (scale-down + scale-up) on an instance."""

    from_model: str | None
    to_model: str
    total_s: float  # on the critical path (a charged load path's wait included)
    load_s: float
    prefetched: bool
    at_s: float
    # request-level-charged: the part of total_s waited out so the scale-up took what the
    # baseline's load path takes (aegaeon_sched.load_path); 0 for every other policy
    charged_s: float = 0.0
    # the model's bytes were still where the arena had last held them: bound, not copied
    resident: bool = False


class TurnRecord(Struct, frozen=True):
    """One decode turn (Alg. 2 line 11): where its time went."""

    model: str
    batch_id: int
    start_s: float
    end_s: float
    quota_s: float
    switch_s: float  # activating the model (critical path)
    kv_wait_s: float  # no request ready: waiting for KV swap-ins
    steps: int
    tokens: int
    engine_s: float = 0.0  # in the engine's decode steps (forward and sampling)


class CudaGraphStats(Struct, frozen=True):
    """What an instance's decode-step CUDA graphs did (aegaeon_engine.graphs): whether
    they are on (``disabled_reason`` when not), the captured batch sizes, the slots
    holding graphs, captures and their seconds, replays, and the steps that ran eager
    by reason (``last_eager_reason`` in words)."""

    enabled: bool
    sizes: list[int] = msgspec.field(default_factory=list)
    slots: int = 0
    captures: int = 0
    capture_s: float = 0.0
    last_capture_s: float = 0.0
    evictions: int = 0
    replays: int = 0
    eager_steps: int = 0
    eager_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    last_eager_reason: str = ""
    disabled_reason: str = ""


class InstanceStats(Message, frozen=True):
    """Periodic heartbeat with cumulative counters and new switch records."""

    TAG = "instance_stats"
    kind: str
    index: int
    active_model: str | None
    queued: int
    running: int
    counters: dict[str, float] = msgspec.field(default_factory=dict)
    switches: list[SwitchRecord] = msgspec.field(default_factory=list)
    turns: list[TurnRecord] = msgspec.field(default_factory=list)
    step_profile: dict[str, list[float]] = msgspec.field(default_factory=dict)
    # Token velocity (TokenScale §III-B): tokens/s over 10 s by stage (arrival,
    # prefill, decode), as its /metrics exports them; the proxy sums the cluster's.
    velocity: dict[str, float] = msgspec.field(default_factory=dict)
    # The models whose weights are on its device (active, being prefetched) and the
    # switcher's count of changes to that set: a later report of an older count is
    # stale (heartbeats and ModelsResident answers travel on different sockets).
    resident_models: list[str] = msgspec.field(default_factory=list)
    residency_version: int = 0
    holdings: Holdings | None = None  # what it holds now (its counters repeat the numbers)
    # the decode step's CUDA graphs (None: an instance that does not say)
    cuda_graphs: CudaGraphStats | None = None


class InstanceDraining(Message, frozen=True):
    """The instance got SIGTERM: send it no new work (answer with ``AckDrain``);
    it finishes what it holds, exits, and says hello again once restarted."""

    TAG = "instance_draining"
    kind: str
    index: int
    pid: int
    timeout_s: float  # it exits by then, finished or not


class InstanceStalled(Message, frozen=True):
    """The instance's compute thread made no progress for ``stalled_s`` (at least the
    config's ``health.stall_s``) while it had work: mark it down now (fail over its
    requests). Its process hears no more hellos from itself: its ``/health`` answers
    503 until its supervisor replaces it (a new pid says hello)."""

    TAG = "instance_stalled"
    kind: str
    index: int
    pid: int
    stalled_s: float
    reason: str = ""


class InstanceModels(Message, frozen=True):
    """The models an instance serves changed (``AddModel``): its KV capacity in tokens
    per model and its latency profile over them, as in a hello."""

    TAG = "instance_models"
    kind: str
    index: int
    incarnation: int
    capacity_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    latency: LatencyProfile | None = None
    ticket: int = 0  # the AddModel's it answers
    reply_to: str = ""  # the proxy replica that asked ("": the proxy)


class ModelsResident(Message, frozen=True):
    """An instance's answer to ``SetModelAwake``: the models on its device after it
    (as ``InstanceStats.resident_models``, with its ``residency_version``)."""

    TAG = "models_resident"
    kind: str
    index: int
    ticket: int
    resident_models: list[str]
    residency_version: int
    reply_to: str = ""  # the proxy replica that asked ("": the proxy)


REPORT_CHANNEL = Channel(
    "instance->proxy",
    [InstanceHello, PrefillDone, StepTokens, RequestFailed, InstanceStats, InstanceDraining,
     InstanceModels, ModelsResident, InstanceStalled],
)
