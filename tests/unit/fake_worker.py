"""An in-memory worker for the compute loops' unit tests (no engine, no cachemgr, no sleep).

:class:`FakeWorker` satisfies :class:`aegaeon_runtime.port.WorkerPort`, the way
vLLM's scheduler tests build a real scheduler over a fake model runner:

- time is a :class:`FakeClock`: ``sleep`` advances it, an engine step advances
  it by the modelled step time (a :class:`~aegaeon_sched.LatencyModel`'s
  Eq. 6), a switch by ``switch_s(model, prefetch, now)``;
- tokens are deterministic: the token at position ``p`` is ``token_at(p)``
  (greedy sampling over one-hot logits);
- the device KV region is a real :class:`~aegaeon_gpumem.KVBlockPool` (the
  bookkeeping is pure), the host cache a counter of offsets;
- every swap-in returns a :class:`FakeEvent`, complete at once unless the
  test said when: ``kv.ready_at[host_offsets] = t`` (the request's handoff
  blocks) completes it at fake time ``t``; a swap-out's event completes
  ``kv.swap_out_s`` after it starts (at once by default), its device blocks
  waiting in the pool's move list until then.

:class:`TimedInbox` delivers each command once the clock reaches its time and
sets ``stop`` when nothing is left and the loop would wait.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aegaeon_common.config import BaselineConfig, Config, SchedulerConfig, SLOConfig
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.messages.decode import EnqueueDecode
from aegaeon_common.messages.report import SwitchRecord
from aegaeon_common.messages.structs import EventSpec, KVHandoff, KVShapeSpec, SamplingParams
from aegaeon_common.transport import RemoteError
from aegaeon_engine import DecodeSeq, KVShape, ModelSpec, RopeSpec, Sampler
from aegaeon_engine.sampling import TokenLogprobs, top_logprobs
from aegaeon_gpumem import Event, EventHandle, KVBlockPool
from aegaeon_runtime.grammar import GrammarCache, ModelVocab
from aegaeon_runtime.kv import shape_key
from aegaeon_runtime.metrics import WorkerMetrics
from aegaeon_sched import SHARED, LatencyModel
from aegaeon_sched import ModelSpec as SchedSpec

VOCAB = 97
BLOCK_SIZE = 16
DTYPE = "float32"


def token_at(position: int) -> int:
    """The token a fake engine produces for the sequence whose newest token is at ``position``."""
    return (position * 31 + 7) % VOCAB


class FakeClock:
    """Seconds that pass only when something says so."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.t = start_s

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeEvent(Event):
    """A copy's event, complete from fake time ``done_at`` on (at once: ``-inf``)."""

    __slots__ = ("clock", "done_at")

    def __init__(self, clock: FakeClock, done_at: float = -math.inf) -> None:
        self.clock = clock
        self.done_at = done_at

    def query(self) -> bool:
        return self.clock.now() >= self.done_at

    def handle(self) -> EventHandle:
        return EventHandle("cpu", "fake", 0, 0)  # a CPU event at value 0: always complete


class FakeKV:
    """The device KV region (a real block pool) and copies that only keep records."""

    def __init__(self, clock: FakeClock, region_bytes: int, slab_bytes: int) -> None:
        self.clock = clock
        self.pool = KVBlockPool(region_bytes, slab_bytes, reclaimer=False)
        self.ready_at: dict[tuple[int, ...], float] = {}  # host offsets -> swap-in completes
        self.swap_ins: list[tuple[int, ...]] = []  # host offsets swapped in, in order
        self.swapped_out: list[list[int]] = []  # device blocks copied out, in order
        self.host_freed: list[int] = []
        self.swap_out_s = 0.0  # how long a swap-out copy runs (its event completes then)
        self._next_host = 1 << 20

    def alloc(self, shape: KVShape, num_blocks: int) -> list[int]:
        if num_blocks == 0:
            return []
        bb = shape.block_bytes
        return [o // bb for o in self.pool.alloc(shape_key(shape), bb, num_blocks)]

    def free(self, shape: KVShape, block_ids: Sequence[int], event: Event | None = None) -> None:
        if block_ids:
            self.pool.free([b * shape.block_bytes for b in block_ids], event)

    def capacity_blocks(self, shape: KVShape) -> int:
        return self.pool.allocator.capacity_blocks(shape.block_bytes)

    def swap_out(self, shape: KVShape, block_ids: Sequence[int]) -> tuple[list[int], Event]:
        host = [self.host_offsets(1)[0] for _ in block_ids]
        done_at = self.clock.now() + self.swap_out_s if self.swap_out_s else -math.inf
        event = FakeEvent(self.clock, done_at)
        self.swapped_out.append(list(block_ids))
        self.free(shape, block_ids, event)
        return host, event

    def swap_in(
        self, shape: KVShape, host_offsets: Sequence[int], block_ids: Sequence[int],
        after: Event | None,
    ) -> Event:  # fmt: skip
        key = tuple(host_offsets)
        self.swap_ins.append(key)
        return FakeEvent(self.clock, self.ready_at.get(key, -math.inf))

    def free_host(self, host_offsets: Sequence[int], event: Event | None) -> None:
        self.host_freed.extend(host_offsets)

    def host_offsets(self, n: int) -> list[int]:
        """Fresh host-cache offsets (a handoff's blocks)."""
        out = list(range(self._next_host, self._next_host + n))
        self._next_host += n
        return out

    def device_bytes_used(self) -> int:
        return int(self.pool.allocator.stats().used_bytes)


class FakeEngine:
    """Logits whose argmax is :func:`token_at`; each call advances the clock."""

    def __init__(self, clock: FakeClock, step_s: Callable[[str, int, int], float],
                 prefill_s: Callable[[str, int], float]) -> None:  # fmt: skip
        self.device = torch.device("cpu")
        self.clock = clock
        self.step_s = step_s
        self.prefill_time_s = prefill_s
        self.model: str | None = None
        self.steps: list[tuple[float, str, tuple[int, ...]]] = []  # (start, model, positions)

    def _one_hot(self, positions: Sequence[int]) -> torch.Tensor:
        logits = torch.zeros(len(positions), VOCAB)
        for row, p in enumerate(positions):
            logits[row, token_at(p)] = 1.0
        return logits

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> torch.Tensor:
        assert self.model is not None
        self.clock.advance(self.prefill_time_s(self.model, len(token_ids)))
        return self._one_hot([len(token_ids) - 1])[0]

    def prefill_scored(self, token_ids: Sequence[int], block_ids: Sequence[int],
                       k: int) -> tuple[torch.Tensor, list[TokenLogprobs]]:
        last = self.prefill(token_ids, block_ids)
        rows = self._one_hot(list(range(len(token_ids) - 1)))
        return last, top_logprobs(rows, list(token_ids[1:]), k)

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        assert self.model is not None
        positions = [s.position for s in seqs]
        self.steps.append((self.clock.now(), self.model, tuple(positions)))
        context = sum(p + 1 for p in positions)
        self.clock.advance(self.step_s(self.model, len(seqs), context))
        return self._one_hot(positions)


class FakeSwitcher:
    """Switches cost ``switch_s(model, prefetch, now)`` (``prefetch``: the model being
    prefetched and since when, or None) of fake time; records every call. As
    ``ModelSwitcher``: one prefetch at a time, taken or dropped by the next switch."""

    def __init__(
        self, engine: FakeEngine, clock: FakeClock,
        switch_s: Callable[[str, tuple[str, float] | None, float], float],
    ) -> None:  # fmt: skip
        self.engine = engine
        self.clock = clock
        self.switch_s = switch_s
        self._active: str | None = None
        self.prefetching: tuple[str, float] | None = None
        self.activations: list[str] = []
        self.prefetches: list[str] = []

    @property
    def active_model(self) -> str | None:
        return self._active

    def activate(self, name: str, now_s: float | None = None) -> SwitchRecord | None:
        if name == self._active:
            return None
        start = self.clock.now()
        cost = self.switch_s(name, self.prefetching, start)
        prefetched = self.prefetching is not None and self.prefetching[0] == name
        self.prefetching = None
        self.clock.advance(cost)
        previous, self._active = self._active, name
        self.engine.model = name
        self.activations.append(name)
        self.residency_version += 1
        return SwitchRecord(previous, name, cost, cost, prefetched, self.clock.wall())

    def prefetch(self, name: str) -> bool:
        if name == self._active:
            return False
        self.prefetches.append(name)
        if self.prefetching is not None:
            return self.prefetching[0] == name
        self.prefetching = (name, self.clock.now())
        self.residency_version += 1
        return True

    residency_version = 0

    def evict(self, name: str) -> bool:
        evicted = False
        if self.prefetching is not None and self.prefetching[0] == name:
            self.prefetching, evicted = None, True
        if self._active == name:
            self._active, evicted = None, True
            self.engine.model = None
        self.residency_version += evicted
        return evicted

    def resident_models(self) -> list[str]:
        names = [self._active] if self._active is not None else []
        if self.prefetching is not None and self.prefetching[0] not in names:
            names.append(self.prefetching[0])
        return names


class FakeCache:
    """The cachemgr's leases as this worker sees them: blocks in ``moved`` are leased
    to another owner now (a free of them is refused whole, as the cachemgr does)."""

    def __init__(self) -> None:
        self.reassigned: list[int] = []
        self.moved: set[int] = set()
        self.freed: list[int] = []

    def reassign_blocks(self, offsets: list[int], new_owner: str, owner: str | None = None) -> int:
        self.reassigned.extend(offsets)
        return len(offsets)

    def free_blocks(self, offsets: list[int], event: EventSpec | None = None) -> int:
        foreign = [o for o in offsets if o in self.moved]
        if foreign:
            raise RemoteError(ErrorReply("not_owner", f"offsets {foreign} are leased elsewhere"))
        self.freed.extend(offsets)
        return len(offsets)


def engine_spec(name: str, num_layers: int = 2) -> ModelSpec:
    return ModelSpec(
        name=name, architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64,
        intermediate_size=128, num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope=RopeSpec(10000.0), max_model_len=4096, dtype=DTYPE,
    )  # fmt: skip


def latency_model(
    models: Sequence[str],
    *,
    step_const_s: float = 0.004,
    step_per_seq_s: float = 0.001,
    switch_s: float = 0.05,
    prefill_per_token_s: float = 1e-4,
) -> LatencyModel:
    """Eq. 4-6 with round numbers: a decode step of any context costs
    ``step_const_s + step_per_seq_s x batch``, a switch ``switch_s``."""
    spec = engine_spec("x")
    width = 4.0 * spec.hidden_size**2 + 2.0 * spec.hidden_size * spec.intermediate_size
    kv_per_token = spec.kv_shape(DTYPE, BLOCK_SIZE).block_bytes // BLOCK_SIZE
    specs = [SchedSpec(m, spec.hidden_size, spec.intermediate_size, spec.num_layers,
                       1 << 20, kv_per_token) for m in models]  # fmt: skip
    lat = LatencyModel(
        specs, pcie_bytes_per_s=(1 << 20) / switch_s, switch_beta=1.0, decode_per_seq_term=True
    )
    layer = spec.num_layers * width
    for m in (*models, SHARED):  # the shared fit: what a model added later gets
        lat.set_decode_coefficients(m, (step_const_s / layer, 0.0, step_per_seq_s / layer))
        lat.set_prefill_coefficients(m, (prefill_per_token_s / layer, 0.0, 0.0))
    return lat


@dataclass
class FakeWorker:
    """See the module docstring; ``truth`` says what steps, prefills and switches take."""

    truth: LatencyModel
    clock: FakeClock = field(default_factory=FakeClock)
    kind: str = "decode"
    index: int = 0
    kv_region_bytes: int = 64 * 8192
    slab_bytes: int = 8 * 8192
    ttft_s: float = 1.0
    tbt_s: float = 0.05
    q_max_s: float = 4.0
    round_ttft_fraction: float | None = 0.7
    token_hold: float = 0.0
    switch_s: Callable[[str, tuple[str, float] | None, float], float] | None = None
    policy: str = "aegaeon"
    baseline: BaselineConfig = field(default_factory=BaselineConfig)

    def __post_init__(self) -> None:
        self.config = Config(
            models=(), dtype=DTYPE, slo=SLOConfig(ttft_s=self.ttft_s, tbt_s=self.tbt_s),
            scheduler=SchedulerConfig(policy=self.policy,  # type: ignore[arg-type]
                                      q_max_s=self.q_max_s, token_hold=self.token_hold,
                                      round_ttft_fraction=self.round_ttft_fraction),
            baseline=self.baseline,
        )  # fmt: skip
        self.specs = {m: engine_spec(m) for m in self.truth.specs}
        truth = self.truth
        self.engine = FakeEngine(self.clock, truth.decode_step_s, truth.prefill_one_s)
        switch = self.switch_s or (lambda m, prefetch, now: truth.switch_s(m))
        self.switcher = FakeSwitcher(self.engine, self.clock, switch)
        self.sampler = Sampler(self.engine.device, seed=0)
        self.kv = FakeKV(self.clock, self.kv_region_bytes, self.slab_bytes)
        self.cache = FakeCache()
        self.metrics = WorkerMetrics(f"{self.kind}-{self.index}")
        # a test that constrains decoding names a tokenizer for its models (model_vocab)
        self.vocabs: dict[str, ModelVocab] = {}
        self.grammars = GrammarCache(lambda m: self.vocabs[m])

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    def kv_shape(self, model: str) -> KVShape:
        return self.specs[model].kv_shape(DTYPE, BLOCK_SIZE)

    def max_model_len(self, model: str) -> int:
        return self.specs[model].max_model_len

    def capacity_tokens(self) -> dict[str, int]:
        return {m: self.kv.capacity_blocks(self.kv_shape(m)) * BLOCK_SIZE for m in self.specs}

    def add_model(self, name: str, path: Path) -> SchedSpec:
        """A fake checkpoint: ``path``'s name is the number of layers."""
        self.specs[name] = engine_spec(name, int(path.name))
        spec = SchedSpec(name, 64, 128, int(path.name), 1 << 20, 512)
        self.truth.specs[name] = spec  # what its steps take here
        return spec

    def enqueue(
        self, request_id: str, model: str, batch_id: int, prompt_len: int, max_tokens: int,
        arrival_s: float,
    ) -> EnqueueDecode:  # fmt: skip
        """A prefilled request's handoff: its prompt's KV in fresh host blocks."""
        shape = self.kv_shape(model)
        spec = KVShapeSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                           shape.block_size, shape.dtype)  # fmt: skip
        blocks = self.kv.host_offsets(shape.blocks_for(prompt_len))
        return EnqueueDecode(
            request_id=request_id, model=model, batch_id=batch_id, prompt_len=prompt_len,
            first_token_id=token_at(prompt_len - 1), num_generated=1,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            handoff=KVHandoff(spec, blocks, prompt_len), arrival_s=arrival_s,
        )  # fmt: skip


class Outbox:
    """Keeps what would have gone to the proxy."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send(self, msg: Any) -> None:
        self.messages.append(msg)

    def of_type(self, kind: type) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind)]


class TimedInbox:
    """Commands delivered once ``clock`` reaches their times; ``stop`` is set when
    none is left and the loop asks to wait (it is idle)."""

    def __init__(self, clock: FakeClock, timed: Sequence[tuple[float, Any]]) -> None:
        self.clock = clock
        self.pending = sorted(timed, key=lambda tm: tm[0])
        self.stop = threading.Event()

    def put(self, at_s: float, msg: Any) -> None:
        self.pending.append((at_s, msg))
        self.pending.sort(key=lambda tm: tm[0])

    def drain(self) -> list[Any]:
        due = [m for t, m in self.pending if t <= self.clock.now()]
        self.pending = [(t, m) for t, m in self.pending if t > self.clock.now()]
        return due

    def wait(self, timeout_s: float) -> list[Any]:
        if not self.pending:
            self.stop.set()
            return []
        nxt = self.pending[0][0]
        if nxt > self.clock.now():
            self.clock.t = min(nxt, self.clock.now() + timeout_s)
        return self.drain()
