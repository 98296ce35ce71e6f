"""Plain data shared by several channels."""

from __future__ import annotations

import msgspec

from aegaeon_common.wire import Struct


class SamplingSpec(Struct, frozen=True):
    """How to sample a request's tokens (validated by the proxy; the engine's
    ``SamplingParams`` takes the same fields and checks them again). The proxy's
    backend contract carries it as it is, so a request has one shape from the
    front to the instances."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # in [0, 2**63); the proxy folds OpenAI's int64 seeds into it
    stop_token_ids: tuple[int, ...] = ()  # EOS included by the proxy unless ignore_eos
    ignore_eos: bool = False
    n: int = 1  # sequences sampled from the one prompt (its KV prefilled once)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int = -1  # top log-probabilities per generated token (-1: none; 0: its own)
    prompt_logprobs: int = -1  # per prompt token (-1: none)
    grammar: str = ""  # an llguidance grammar the tokens must follow ("": none)


class TokenLogprobs(Struct, frozen=True):
    """A token's log-probability and the most likely tokens' (best first), from the
    model's logits before any sampling parameter touched them."""

    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)
    rank: int = 1  # in the whole vocabulary (1: the most likely)


class KVShapeSpec(Struct, frozen=True):
    """A KV block shape; a slab of the unified cache serves exactly one."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


class EventSpec(Struct, frozen=True):
    """A transfer event another process can open (see aegaeon_gpumem events).

    CPU: ``kind="cpu"``, complete when slot ``slot`` of table ``table`` >= ``value``.
    CUDA: ``kind="cuda"``, ``handle`` is the IPC event handle on ``device``.
    """

    kind: str
    table: str = ""
    slot: int = 0
    value: int = 0
    handle: bytes = b""
    device: int = 0


class KVHandoff(Struct, frozen=True):
    """A prefilled request's KV in the unified CPU cache, on its way to decode."""

    shape: KVShapeSpec
    block_offsets: list[int]
    num_tokens: int
    event: EventSpec | None = None  # the swap-out copy; consumers wait on it


class Holdings(Struct, frozen=True):
    """What an instance holds for its requests (``/v1/aegaeon/stats``: all 0 when idle).

    Read by its heartbeat, and by its compute thread when a message ends or hands on
    a request (after that request's KV was freed and its queues updated): the message
    carries it, so the proxy knows before it answers the client. ``version`` counts
    the compute thread's readings; a reading of a lower version is older (heartbeats
    and request messages travel on different sockets) and never replaces a newer one.
    ``incarnation`` is the process's (``InstanceHello.incarnation``): versions of
    different processes do not compare.
    """

    version: int
    kv_blocks_in_use: int  # device KV blocks allocated or waiting on the move list
    open_sequences: int  # requests queued for prefill or in the decode work list
    incarnation: int = 0


class RequestTimings(Struct, frozen=True):
    """Where a request's time went (paper Fig. 14), seconds."""

    prefill_wait_s: float = 0.0
    prefill_s: float = 0.0
    decode_wait_s: float = 0.0
    decode_s: float = 0.0
    kv_wait_s: float = 0.0  # data overhead: waiting for KV transfers
    kv_control_s: float = 0.0  # control overhead: block bookkeeping, events
    extra: dict[str, float] = msgspec.field(default_factory=dict)


class ModelSizes(Struct, frozen=True):
    """The sizes a latency model estimates one model with (``aegaeon_sched.ModelSpec``)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    weight_bytes: int
    kv_bytes_per_token: int


class LatencyProfile(Struct, frozen=True):
    """An instance's fitted latency model: ``aegaeon_sched.LatencyModel.to_dict()``
    typed for the wire (``from_dict`` takes its plain form back)."""

    version: int
    pcie_bytes_per_s: float
    switch_beta: float
    attn_block: int
    decode_per_seq_term: bool
    models: dict[str, ModelSizes]
    prefill_coef: dict[str, list[float]] = msgspec.field(default_factory=dict)
    decode_coef: dict[str, list[float]] = msgspec.field(default_factory=dict)
