"""Plain data shared by several channels."""

from __future__ import annotations

import math

import msgspec

from aegaeon_common.wire import Struct

MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's bound)
SEED_RANGE = 1 << 63  # seeds in [0, 2**63)


class SamplingParams(Struct, frozen=True, kw_only=True):
    """How to sample a request's tokens: the one shape from the HTTP request to the
    sampler. The proxy fills it from the body (a 400 naming the field on a bad value),
    the wire carries it as it is, the engine's sampler reads it; its own check (here,
    also when a frame is decoded) refuses what no sampler can do.

    ``temperature == 0`` is greedy; ``top_k == 0`` is off; ``seed`` makes the request
    reproducible whatever it is batched with. ``stop_token_ids`` holds the model's EOS
    ids unless ``ignore_eos`` (the proxy adds them: an instance never needs to know
    the model's EOS itself)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # in [0, 2**63); the proxy folds OpenAI's int64 seeds into it
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # sequences sampled from the one prompt (its KV prefilled once)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0  # in [-2, 2], on tokens generated at least once
    frequency_penalty: float = 0.0  # in [-2, 2], times how often each was generated
    repetition_penalty: float = 1.0  # > 0; on tokens of the prompt and generated ones
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # id -> [-100, 100]
    allowed_token_ids: tuple[int, ...] = ()  # only these (empty: any)
    min_tokens: int = 0  # no stop token before this many generated
    logprobs: int = -1  # top log-probabilities per generated token (-1: none; 0: its own)
    prompt_logprobs: int = -1  # per prompt token (-1: none)
    grammar: str = ""  # an llguidance grammar the tokens must follow ("": none)

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        def number(name: str, low: float, high: float, low_open: bool = False) -> None:
            v = getattr(self, name)
            if (not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v)
                    or not (low < v if low_open else low <= v) or not v <= high):
                interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
                raise fail(name, f"must be a number in {interval}")

        def count(name: str, low: int, high: int | None = None) -> None:
            v = getattr(self, name)
            if (not isinstance(v, int) or isinstance(v, bool) or v < low
                    or (high is not None and v > high)):
                raise fail(name, f"must be an int in [{low}, {high}]" if high is not None
                           else f"must be an int >= {low}")

        def token_ids(name: str) -> None:
            ids = getattr(self, name)
            if not isinstance(ids, list | tuple) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise fail(name, "must be a sequence of token ids >= 0")
            if isinstance(ids, list):  # a caller's list (a frame decodes to a tuple)
                msgspec.structs.force_setattr(self, name, tuple(ids))

        number("temperature", 0.0, math.inf)
        number("top_p", 0.0, 1.0, low_open=True)
        count("top_k", 0)
        if self.seed is not None:
            count("seed", 0, SEED_RANGE - 1)
        count("max_tokens", 1)
        count("n", 1)
        token_ids("stop_token_ids")
        token_ids("allowed_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise fail("ignore_eos", "must be a bool")
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 1e6, low_open=True)
        bias = self.logit_bias
        if not isinstance(bias, dict) or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0
                and isinstance(v, int | float) and not isinstance(v, bool) and -100 <= v <= 100
                for k, v in bias.items()):
            raise fail("logit_bias", "must map token ids >= 0 to numbers in [-100, 100]")
        count("min_tokens", 0)  # above max_tokens: no stop at all (the proxy refuses it)
        count("logprobs", -1, MAX_LOGPROBS)
        count("prompt_logprobs", -1, MAX_LOGPROBS)
        if not isinstance(self.grammar, str):
            raise fail("grammar", "must be a string")

    @property
    def greedy(self) -> bool:
        """The argmax is always taken (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Its logits need more than temperature, top-k and top-p (the sampler's
        :func:`process_logits`): a grammar, a bias, penalties, ``min_tokens``..."""
        return bool(self.grammar or self.logit_bias or self.allowed_token_ids
                    or self.min_tokens or self.min_p or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1.0)


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
