"""An in-memory worker the runtime's real compute loops run on: what live takes time, costs time.

:class:`SimWorker` satisfies :class:`aegaeon_runtime.port.WorkerPort`, the way
vLLM's scheduler tests build a real scheduler over a fake model runner. The
simulator runs every instance's own loop over one (``aegaeon_sim.instances``);
the loops' unit tests do too (tests/unit/fake_worker.py, on a :class:`FakeClock`).

- time is the ``clock``'s (an :class:`AdvancingClock`): an engine step
  advances it by the truth latency model's Eq. 6 (plus ``cold_step_s`` on the
  first step after a switch), a prefill by Eq. 5, a switch by
  ``switch_s(model, prefetch, now)``; :class:`WorkerCosts` adds the live loop's
  own time where it spends it (per activation, per swap-out order);
- tokens are deterministic: the token after position ``p`` is :func:`token_at`
  (:class:`PositionSampler`, greedy over the engine's last step; no logits are made);
  with ``logits=True`` the engine makes one-hot logits whose argmax is that token
  and the real :class:`~aegaeon_engine.Sampler` samples them (a loop's unit test
  that asks for log-probabilities, seeded sampling or several choices);
- the device KV region is a real :class:`~aegaeon_gpumem.KVBlockPool` (the
  bookkeeping is pure); the unified CPU cache is :class:`HostBlocks`, shared by
  a node's workers: a swap-out's blocks are readable once its copy completes, a
  swap-in starts once its blocks are readable, each copy taking its bytes over
  ``copy_bytes_per_s``; a test may fix a swap-in's completion (``kv.ready_at``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from aegaeon_common.config import Config
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.messages.report import SwitchRecord
from aegaeon_common.messages.structs import EventSpec
from aegaeon_common.transport import RemoteError
from aegaeon_engine import DecodeSeq, KVShape, ModelSpec, RopeSpec, Sampler, SamplingParams
from aegaeon_engine.sampling import RowState, TokenLogprobs, top_logprobs
from aegaeon_gpumem import Event, EventHandle, KVBlockPool
from aegaeon_runtime.grammar import GrammarCache, ModelVocab
from aegaeon_runtime.kv import shape_key
from aegaeon_runtime.metrics import WorkerMetrics
from aegaeon_sched import LatencyModel
from aegaeon_sched import ModelSpec as SchedSpec

VOCAB = 97
BLOCK_SIZE = 16
# A step takes at least this long. Eq. 6 is clamped at zero, and a profile fitted
# on a busy machine can have a negative context slope (seen: a 19M model at 2k
# tokens); a step of no time would emit a whole request at one instant.
MIN_STEP_S = 1e-6

# (model, the prefetch in flight: (model, started at) or None, now) -> switch seconds
SwitchCost = Callable[[str, "tuple[str, float] | None", float], float]


def token_at(position: int) -> int:
    """The token a fake engine produces for the sequence whose newest token is at ``position``."""
    return (position * 31 + 7) % VOCAB


def engine_spec(spec: SchedSpec, vocab_size: int = VOCAB, max_model_len: int = 1 << 20,
                dtype: str = "bfloat16") -> ModelSpec:
    """An engine spec whose KV shape holds ``spec.kv_bytes_per_token`` per token (in
    ``dtype``): what a simulated worker needs of a model (its KV blocks' size)."""
    itemsize = 4 if dtype == "float32" else 2
    per_layer, rest = divmod(spec.kv_bytes_per_token, 2 * itemsize * spec.num_layers)
    layers, head_dim = spec.num_layers, per_layer
    if rest or not per_layer:  # not a whole number per layer: one layer holds it all
        layers, head_dim = 1, -(-spec.kv_bytes_per_token // (2 * itemsize))
    return ModelSpec(
        name=spec.name, architecture="LlamaForCausalLM", vocab_size=vocab_size,
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5,
        rope=RopeSpec(10000.0), max_model_len=max_model_len, dtype=dtype,
    )  # fmt: skip


class AdvancingClock(Protocol):
    """The runtime's ``Clock`` port plus ``advance``: an operation taking time."""

    def now(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def advance(self, seconds: float) -> None: ...


class FakeClock:
    """Seconds that pass only when something says so (a loop driven alone, in a test)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.t = start_s

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    wall = now  # fake time is the only time
    advance = sleep


class FakeEvent(Event):
    """A copy's event, complete from fake time ``done_at`` on (at once: ``-inf``)."""

    __slots__ = ("clock", "done_at")

    def __init__(self, clock: AdvancingClock, done_at: float = -math.inf) -> None:
        self.clock = clock
        self.done_at = done_at

    def query(self) -> bool:
        return self.clock.now() >= self.done_at

    def handle(self) -> EventHandle:
        return EventHandle("cpu", "fake", 0, 0)  # a CPU event at value 0: always complete


class HostBlocks:
    """The unified CPU KV cache's blocks: fresh offsets, and when each becomes readable
    (the swap-out that wrote it completes). One per node, shared by its workers."""

    def __init__(self) -> None:
        self.ready_s: dict[int, float] = {}
        self._next = 1 << 20

    def alloc(self, n: int, ready_s: float = -math.inf) -> list[int]:
        out = list(range(self._next, self._next + n))
        self._next += n
        for offset in out:
            self.ready_s[offset] = ready_s
        return out

    def readable_s(self, offsets: Sequence[int]) -> float:
        return max((self.ready_s.get(o, -math.inf) for o in offsets), default=-math.inf)

    def free(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            self.ready_s.pop(offset, None)


class FakeKV:
    """The device KV region (a real block pool) and copies that take their bytes'
    time (``copy_bytes_per_s``; a swap-out at least ``swap_out_s``) and keep records.
    ``swap_out_order_s``: the loop's own time to order a swap-out (host blocks from
    the cachemgr, the copy's launch)."""

    def __init__(
        self, clock: AdvancingClock, region_bytes: int, slab_bytes: int, *,
        host: HostBlocks | None = None, copy_bytes_per_s: float = math.inf,
        swap_out_order_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.clock = clock
        self.pool = KVBlockPool(region_bytes, slab_bytes, reclaimer=False)
        self.host = host or HostBlocks()
        self.copy_bytes_per_s = copy_bytes_per_s
        self.swap_out_order_s = swap_out_order_s
        self.swap_out_s = 0.0
        self.ready_at: dict[tuple[int, ...], float] = {}  # host offsets -> swap-in completes
        self.swap_ins: list[tuple[int, ...]] = []  # host offsets swapped in, in order
        self.swapped_out: list[list[int]] = []  # device blocks copied out, in order
        self.host_freed: list[int] = []
        self.record = True  # keep the three lists above (a test reads them)

    def _copy_s(self, shape: KVShape, num_blocks: int) -> float:
        return num_blocks * shape.block_bytes / self.copy_bytes_per_s

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
        self.clock.advance(self.swap_out_order_s)
        copy_s = max(self.swap_out_s, self._copy_s(shape, len(block_ids)))
        done_at = self.clock.now() + copy_s if copy_s > 0 else -math.inf
        host = self.host.alloc(len(block_ids), done_at)
        event = FakeEvent(self.clock, done_at)
        if self.record:
            self.swapped_out.append(list(block_ids))
        self.free(shape, block_ids, event)
        return host, event

    def swap_in(
        self, shape: KVShape, host_offsets: Sequence[int], block_ids: Sequence[int],
        after: Event | None,
    ) -> Event:  # fmt: skip
        key = tuple(host_offsets)
        if self.record:
            self.swap_ins.append(key)
        done_at = self.ready_at.get(key)
        if done_at is None:  # once its blocks are readable, the copy's bytes
            start = max(self.clock.now(), self.host.readable_s(host_offsets))
            copy_s = self._copy_s(shape, len(host_offsets))
            done_at = start + copy_s if copy_s > 0 or start > self.clock.now() else -math.inf
        return FakeEvent(self.clock, done_at)

    def free_host(self, host_offsets: Sequence[int], event: Event | None) -> None:
        if self.record:
            self.host_freed.extend(host_offsets)
        self.host.free(host_offsets)

    def host_offsets(self, n: int) -> list[int]:
        """Fresh host-cache offsets (a handoff's blocks, readable now)."""
        return self.host.alloc(n)

    def device_bytes_used(self) -> int:
        return int(self.pool.allocator.stats().used_bytes)


class FakeEngine:
    """Each call takes its modelled time. The engine keeps the positions it stepped
    (``positions``), which :class:`PositionSampler` turns into the next tokens
    (:func:`token_at`), as greedy sampling over real logits would; no logits are
    computed unless ``logits`` (one-hot, their argmax that token)."""

    def __init__(
        self, clock: AdvancingClock, step_s: Callable[[str, int, int], float],
        prefill_s: Callable[[str, int], float], *, cold_step_s: float = 0.0,
        record: bool = True, logits: bool = False,
    ) -> None:  # fmt: skip
        self.device = torch.device("cpu")
        self.clock = clock
        self.step_s = step_s
        self.prefill_time_s = prefill_s
        self.cold_step_s = cold_step_s
        self.model: str | None = None
        self.cold = False  # the next decode step is the first after a switch
        self.record = record
        self.logits = logits
        self.positions: list[int] = []  # of the last call's sequences
        self.steps: list[tuple[float, str, tuple[int, ...]]] = []  # (start, model, positions)
        self.step_adapters: list[tuple[str | None, ...]] = []  # each step's rows' adapters
        self.prefill_adapters: list[str | None] = []  # each prefill's adapter

    def _out(self, positions: list[int]) -> torch.Tensor:
        self.positions = positions
        return _one_hot(positions) if self.logits else _NO_LOGITS

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int], start_pos: int = 0,
                adapter: object = None) -> torch.Tensor:
        assert self.model is not None
        self.cold = False
        if self.record:
            self.prefill_adapters.append(None if adapter is None else str(adapter))
        self.clock.advance(self.prefill_time_s(self.model, len(token_ids)))
        out = self._out([len(token_ids) - 1])
        return out[0] if self.logits else out

    def prefill_scored(self, token_ids: Sequence[int], block_ids: Sequence[int], k: int,
                       start_pos: int = 0, adapter: object = None,
                       ) -> tuple[torch.Tensor, list[TokenLogprobs]]:
        last = self.prefill(token_ids, block_ids)
        rows = _one_hot(list(range(len(token_ids) - 1)))
        return last, top_logprobs(rows, list(token_ids[1:]), k)

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        assert self.model is not None
        positions = [s.position for s in seqs]
        if self.record:
            self.steps.append((self.clock.now(), self.model, tuple(positions)))
            self.step_adapters.append(tuple(None if s.adapter is None else str(s.adapter)
                                            for s in seqs))
        context = sum(positions) + len(positions)
        step = self.step_s(self.model, len(positions), context)
        if self.cold:
            step += self.cold_step_s
            self.cold = False
        self.clock.advance(max(step, MIN_STEP_S))
        return self._out(positions)


_NO_LOGITS = torch.empty(0)


def _one_hot(positions: Sequence[int]) -> torch.Tensor:
    logits = torch.zeros(len(positions), VOCAB)
    for row, p in enumerate(positions):
        logits[row, token_at(p)] = 1.0
    return logits


class PositionSampler:
    """Greedy sampling over the fake engine's last call: the token after each position."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        states: Sequence[RowState] | None = None,
    ) -> list[int]:  # fmt: skip
        return [token_at(p) for p in self.engine.positions]


class FakeSwitcher:
    """Switches cost ``switch_s(model, prefetch, now)`` (``prefetch``: the model being
    prefetched and since when, or None) of fake time; records every call. As
    ``ModelSwitcher``: one prefetch at a time, taken or dropped by the next switch;
    none with ``prefetch=False``; with ``keep_resident`` (static multiplexing) a model
    once switched in stays, and switching back to it costs what activating a completed
    prefetch does. ``activate_s``: the loop's own time per activation, switch or not."""

    def __init__(
        self, engine: FakeEngine, clock: AdvancingClock, switch_s: SwitchCost, *,
        weight_bytes: Mapping[str, int] | None = None, prefetch: bool = True,
        keep_resident: bool = False, activate_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.clock = clock
        self.switch_s = switch_s
        self.weight_bytes = weight_bytes if weight_bytes is not None else {}
        self.prefetch_enabled = prefetch
        self.keep_resident = keep_resident
        self.activate_s = activate_s
        self._active: str | None = None
        self._kept: set[str] = set()
        self.prefetching: tuple[str, float] | None = None
        self.activations: list[str] = []
        self.prefetches: list[str] = []
        self.residency_version = 0

    @property
    def active_model(self) -> str | None:
        return self._active

    def nbytes(self, name: str) -> int:
        return self.weight_bytes[name]

    def activate(self, name: str, now_s: float | None = None) -> SwitchRecord | None:
        self.clock.advance(self.activate_s)
        if name == self._active:
            return None
        start = self.clock.now()
        kept = name in self._kept
        cost = self.switch_s(name, (name, -math.inf) if kept else self.prefetching, start)
        prefetched = kept or (self.prefetching is not None and self.prefetching[0] == name)
        self.prefetching = None
        self.clock.advance(cost)
        previous, self._active = self._active, name
        if self.keep_resident:
            self._kept.add(name)
        self.engine.model = name
        self.engine.cold = True
        self.activations.append(name)
        self.residency_version += 1
        return SwitchRecord(previous, name, cost, cost, prefetched, self.clock.wall(),
                            resident=kept)  # fmt: skip

    def prefetch(self, name: str) -> bool:
        if not self.prefetch_enabled or name == self._active or name in self._kept:
            return False
        self.prefetches.append(name)
        if self.prefetching is not None:
            return self.prefetching[0] == name
        self.prefetching = (name, self.clock.now())
        self.residency_version += 1
        return True

    def evict(self, name: str) -> bool:
        evicted = name in self._kept
        self._kept.discard(name)
        if self.prefetching is not None and self.prefetching[0] == name:
            self.prefetching, evicted = None, True
        if self._active == name:
            self._active, evicted = None, True
            self.engine.model = None
        self.residency_version += evicted
        return evicted

    def resident_models(self) -> list[str]:
        names = [self._active] if self._active is not None else []
        names += sorted(m for m in self._kept if m not in names)
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
        self.record = True

    def reassign_blocks(self, offsets: list[int], new_owner: str, owner: str | None = None) -> int:
        if self.record:
            self.reassigned.extend(offsets)
        return len(offsets)

    def free_blocks(self, offsets: list[int], event: EventSpec | None = None) -> int:
        foreign = [o for o in offsets if o in self.moved]
        if foreign:
            raise RemoteError(ErrorReply("not_owner", f"offsets {foreign} are leased elsewhere"))
        if self.record:
            self.freed.extend(offsets)
        return len(offsets)


class QuietMetrics(WorkerMetrics):
    """A simulated instance's metrics: the simulator reads the loops' counters, so
    nothing is counted or logged here (no registry, no line per switch)."""

    def __init__(self, instance: str) -> None:  # no super().__init__: no registry
        self.instance = instance

    def bad_frame(self, code: str) -> None:
        pass

    def request_done(self, stage: str, model: str, outcome: str) -> None:
        pass

    def tokens(self, stage: str, model: str, num_tokens: int) -> None:
        pass

    def velocity(self) -> dict[str, float]:
        return {}

    def switch(self, record: SwitchRecord) -> None:
        pass


class SimAdapters:
    """A simulated worker's LoRA adapters, as the loops use ``AdapterResidency``: an
    adapter's "weights" are its name; its first step on this instance brings its own
    matrices there (Eq. 4 over its bytes, on the worker's clock: megabytes, not a
    weight switch), and they stay, as on a live CPU worker (views over the Model
    Cache) and in a GPU's adapter region until it fills."""

    def __init__(self, units: Mapping[str, str], latency: LatencyModel,
                 clock: AdvancingClock) -> None:  # fmt: skip
        self.bases = dict(units)
        self.latency, self.clock = latency, clock
        self.placed: list[str] = []
        self.num_loads = 0
        self.version = 0

    @property
    def specs(self) -> dict[str, str]:
        return self.bases

    def base_of(self, name: str) -> str | None:
        return self.bases.get(name)

    def nbytes(self, name: str) -> int:
        return self.latency.spec(name).weight_bytes

    def for_step(self, names: Sequence[str | None]) -> list[Any]:
        for name in names:
            if name is not None and name not in self.placed:
                self.clock.advance(self.latency.switch_s(name))
                self.placed.append(name)
                self.num_loads += 1
                self.version += 1
        return list(names)

    def with_adapters(self, models: Sequence[str]) -> list[str]:
        return [*models, *(a for a in self.placed if self.bases[a] in models)]

    def evict(self, name: str) -> bool:
        if name in self.placed:
            self.placed.remove(name)
            self.version += 1
            return True
        return False


@dataclass(frozen=True)
class WorkerCosts:
    """What a worker's operations cost besides the truth latency model (seconds):
    ``cold_step_s`` on the first decode step after a switch; the live loop's own time
    per activation (``activate_s``: a decode turn's or a prefill's start, switch or
    not) and per swap-out order (``swap_out_order_s``); KV copies over
    ``copy_bytes_per_s``."""

    cold_step_s: float = 0.0
    activate_s: float = 0.0
    swap_out_order_s: float = 0.0
    copy_bytes_per_s: float = math.inf


def _no_vocab(model: str) -> ModelVocab:
    raise ValueError(f"model {model!r}: a simulated worker has no tokenizer (no grammar)")


class SimWorker:
    """See the module docstring: ``truth`` says what steps, prefills and (by default)
    switches take; ``specs`` are the models' engine specs (their KV shapes)."""

    def __init__(
        self, config: Config, kind: str, index: int, specs: Mapping[str, ModelSpec],
        truth: LatencyModel, clock: AdvancingClock, *, kv_region_bytes: int,
        slab_bytes: int, switch_s: SwitchCost | None = None, costs: WorkerCosts = WorkerCosts(),
        host: HostBlocks | None = None, keep_resident: bool = False, prefetch: bool = True,
        record: bool = True, metrics: WorkerMetrics | None = None, logits: bool = False,
        vocab: Callable[[str], ModelVocab] | None = None, units: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        """``units``: the LoRA adapters among ``specs``, each with its base."""
        self.config = config
        self.kind = kind
        self.index = index
        self.specs: dict[str, ModelSpec] = dict(specs)
        self.truth = truth
        self.clock = clock
        self.engine = FakeEngine(clock, truth.decode_step_s, truth.prefill_one_s,
                                 cold_step_s=costs.cold_step_s, record=record,
                                 logits=logits)  # fmt: skip
        switch = switch_s or (lambda m, prefetch, now: truth.switch_s(m))
        weights = {m: s.weight_bytes for m, s in truth.specs.items()}
        self.switcher = FakeSwitcher(self.engine, clock, switch, weight_bytes=weights,
                                     prefetch=prefetch, keep_resident=keep_resident,
                                     activate_s=costs.activate_s)  # fmt: skip
        self.sampler: PositionSampler | Sampler = (
            Sampler(self.engine.device, seed=0) if logits else PositionSampler(self.engine))
        # constrained decoding needs a model's tokenizer: ``vocab`` names it (a simulated
        # market has none: its requests carry no grammar)
        self.grammars = GrammarCache(vocab or _no_vocab)
        self.kv = FakeKV(clock, kv_region_bytes, slab_bytes, host=host,
                         copy_bytes_per_s=costs.copy_bytes_per_s,
                         swap_out_order_s=costs.swap_out_order_s)  # fmt: skip
        self.kv.record = record
        self.cache = FakeCache()
        self.cache.record = record
        self.metrics = metrics if metrics is not None else QuietMetrics(self.name)
        self.adapters = SimAdapters(units or {}, truth, clock)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    def kv_shape(self, model: str) -> KVShape:
        return self.specs[self.unit_of(model)].kv_shape(self.config.dtype, BLOCK_SIZE)

    def unit_of(self, model: str) -> str:
        """The model whose weights serve ``model``: a LoRA adapter's base, else itself."""
        return self.adapters.base_of(model) or model

    def max_model_len(self, model: str) -> int:
        return self.specs[model].max_model_len

    def capacity_tokens(self) -> dict[str, int]:
        return {m: self.kv.capacity_blocks(self.kv_shape(m)) * BLOCK_SIZE for m in self.specs}

    def add_model(self, name: str, path: Path, base: str | None = None) -> SchedSpec:
        """A simulated market is fixed when the run starts: there is no checkpoint to read."""
        raise ValueError(f"model {name!r}: a simulated worker serves the models it was built "
                         "with (no checkpoint is read)")
