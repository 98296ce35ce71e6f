"""What the compute loops use of a worker: a narrow protocol over its ``Worker``.

The decode instance's turn runner, admission and residency
(:mod:`aegaeon_runtime.decode`), a hybrid's prefill side and the prefill loop
depend on :class:`WorkerPort`, not on the worker that builds a device
buffer, an engine and a cachemgr lease: a test drives them with an in-memory
fake (tests/unit/fake_worker.py: deterministic tokens, steps that advance a
fake clock, copy events that complete when the test says), the way vLLM
tests its scheduler without a GPU. ``Worker`` satisfies it as it is.

Members are read-only properties, so an implementation may narrow their
types (``Worker.engine`` is an ``Engine``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from aegaeon_common.config import Config
from aegaeon_common.messages.report import SwitchRecord
from aegaeon_common.messages.structs import EventSpec
from aegaeon_common.wire import Message
from aegaeon_engine import DecodeSeq, KVShape, ModelSpec, SamplingParams
from aegaeon_engine.sampling import RowState, TokenLogprobs
from aegaeon_gpumem import Event, KVBlockPool
from aegaeon_sched import ModelSpec as SchedSpec

from aegaeon_runtime.errors import ModelGoneError, ModelUnavailableError
from aegaeon_runtime.grammar import GrammarCache
from aegaeon_runtime.metrics import WorkerMetrics

if TYPE_CHECKING:
    from aegaeon_engine.lora import AdapterWeights

__all__ = ["AdapterPort", "EnginePort", "HostCachePort", "KVPort", "MessageSink", "MessageSource",
           "ModelGoneError", "ModelUnavailableError", "SamplerPort", "SwitcherPort",
           "WorkerPort"]


class EnginePort(Protocol):
    @property
    def device(self) -> torch.device: ...

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int], start_pos: int = 0,
                adapter: AdapterWeights | None = None) -> torch.Tensor:
        """One prompt's K/V into ``block_ids``; the logits ``[vocab]`` of its last position
        (with ``adapter``: that LoRA adapter of the bound model runs with it)."""
        ...

    def prefill_scored(self, token_ids: Sequence[int], block_ids: Sequence[int], k: int,
                       start_pos: int = 0, adapter: AdapterWeights | None = None,
                       ) -> tuple[torch.Tensor, list[TokenLogprobs]]:
        """:meth:`prefill`, and each prompt token's (from the second) log-probability
        with the ``k`` most likely tokens at its position."""
        ...

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One step of a batch (of the bound model and its adapters, ``DecodeSeq.adapter``):
        logits ``[B, vocab]``."""
        ...


class SamplerPort(Protocol):
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        states: Sequence[RowState] | None = None,
    ) -> list[int]: ...


class AdapterPort(Protocol):
    """What the loops use of a worker's LoRA adapters
    (:class:`aegaeon_runtime.adapters.AdapterResidency`)."""

    @property
    def specs(self) -> Mapping[str, object]:
        """The adapters served here, by name."""
        ...

    @property
    def num_loads(self) -> int:
        """Adapters brought to the device so far."""
        ...

    @property
    def version(self) -> int:
        """Changes with what is on the device."""
        ...

    def base_of(self, name: str) -> str | None: ...

    def nbytes(self, name: str) -> int: ...

    def for_step(self, names: Sequence[str | None]) -> Sequence[AdapterWeights | None]:
        """Each row's adapter on the device (None: the base's row, or no room now)."""
        ...

    def with_adapters(self, models: Sequence[str]) -> list[str]: ...

    def evict(self, name: str) -> bool: ...


class SwitcherPort(Protocol):
    @property
    def active_model(self) -> str | None: ...

    def activate(self, name: str, now_s: float | None = None) -> SwitchRecord | None:
        """Make ``name`` the engine's model (blocking); ``None`` if it already is.
        Raises :class:`ModelGoneError` when the node's cachemgr no longer holds it, or
        cannot read it (:class:`ModelUnavailableError`)."""
        ...

    def prefetch(self, name: str) -> bool:
        """Start loading ``name`` behind the active model; ``False`` if it cannot now."""
        ...

    def evict(self, name: str) -> bool:
        """Take ``name`` off the device (nothing of it may run before its next
        activation); True if it was there."""
        ...

    def resident_models(self) -> list[str]:
        """The models on the device (the active one, the one being prefetched)."""
        ...

    @property
    def residency_version(self) -> int:
        """Changes to :meth:`resident_models` so far."""
        ...

    def nbytes(self, name: str) -> int:
        """The bytes a scale-up of ``name`` copies here (its packed weights; a
        tensor-parallel rank's: its shard's)."""
        ...


class KVPort(Protocol):
    """The device KV region and its copies to and from the unified CPU cache."""

    @property
    def pool(self) -> KVBlockPool: ...

    def alloc(self, shape: KVShape, num_blocks: int) -> list[int]: ...

    def free(
        self, shape: KVShape, block_ids: Sequence[int], event: Event | None = None
    ) -> None: ...

    def capacity_blocks(self, shape: KVShape) -> int: ...

    def swap_out(self, shape: KVShape, block_ids: Sequence[int]) -> tuple[list[int], Event]: ...

    def swap_in(
        self, shape: KVShape, host_offsets: Sequence[int], block_ids: Sequence[int],
        after: Event | None,
    ) -> Event: ...  # fmt: skip

    def free_host(self, host_offsets: Sequence[int], event: Event | None) -> None: ...


class HostCachePort(Protocol):
    def reassign_blocks(self, offsets: list[int], new_owner: str, owner: str | None = None) -> int:
        """Move host blocks' lease to ``new_owner`` (a handoff taken over)."""
        ...

    def free_blocks(self, offsets: list[int], event: EventSpec | None = None) -> object:
        """End this worker's lease of host blocks (``RemoteError`` ``not_owner`` when
        any is leased to another owner: nothing is freed then)."""
        ...


class WorkerPort(Protocol):
    """What the compute loops use of a worker (see the module docstring)."""

    @property
    def config(self) -> Config: ...

    @property
    def kind(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def specs(self) -> Mapping[str, ModelSpec]: ...

    @property
    def engine(self) -> EnginePort: ...

    @property
    def sampler(self) -> SamplerPort: ...

    @property
    def switcher(self) -> SwitcherPort: ...

    @property
    def kv(self) -> KVPort: ...

    @property
    def cache(self) -> HostCachePort: ...

    @property
    def metrics(self) -> WorkerMetrics: ...

    @property
    def grammars(self) -> GrammarCache:
        """Grammar matchers for constrained decoding (:mod:`aegaeon_runtime.grammar`)."""
        ...

    def kv_shape(self, model: str) -> KVShape: ...

    def max_model_len(self, model: str) -> int: ...

    def capacity_tokens(self) -> dict[str, int]:
        """Device KV capacity in tokens, per model."""
        ...

    def add_model(self, name: str, path: Path, base: str | None = None) -> SchedSpec:
        """Serve one more model (with ``base``: a LoRA adapter of that served model);
        its spec for the latency model."""
        ...

    def unit_of(self, model: str) -> str:
        """The model whose weights serve ``model`` (a LoRA adapter's base), else itself."""
        ...

    @property
    def adapters(self) -> AdapterPort:
        """The LoRA adapters served here and those on the device."""
        ...


class MessageSink(Protocol):
    """Where a compute loop's messages go (:class:`~aegaeon_runtime.bridge.Outbox`)."""

    def send(self, msg: Message) -> None: ...


class MessageSource(Protocol):
    """A compute loop's commands (:class:`~aegaeon_runtime.bridge.Inbox`)."""

    def drain(self) -> list[Message]: ...

    def wait(self, timeout_s: float) -> list[Message]: ...
