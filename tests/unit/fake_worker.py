"""The compute loops' unit tests drive them alone on the simulator's in-memory worker.

:class:`FakeWorker` is :class:`aegaeon_sim.worker.SimWorker` (the one fake of the
runtime's ports: engine, switcher, KV, host cache; what the simulator runs every
instance's loop on) with a test's defaults: tiny models, a :class:`FakeClock` that
moves only when the loop waits or works, a small KV region, copies that take no
time unless a test says (``kv.ready_at``, ``kv.swap_out_s``), one-hot logits for the
real sampler (a test may ask for log-probabilities, seeds, several choices), the
tokenizers a test names for constrained decoding (``vocabs``) and real metrics.

:class:`TimedInbox` delivers each command once the clock reaches its time and
sets ``stop`` when nothing is left and the loop would wait; :class:`Outbox`
keeps what the loop sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
from aegaeon_common.config import BaselineConfig, Config, SchedulerConfig, SLOConfig
from aegaeon_common.messages.decode import EnqueueDecode
from aegaeon_common.messages.structs import KVHandoff, KVShapeSpec, LatencyProfile, SamplingParams
from aegaeon_engine import ModelSpec, RopeSpec, weight_layout
from aegaeon_runtime.grammar import ModelVocab
from aegaeon_runtime.metrics import WorkerMetrics
from aegaeon_sched import SHARED, LatencyModel
from aegaeon_sched import ModelSpec as SchedSpec
from aegaeon_sim.worker import BLOCK_SIZE, VOCAB, AdvancingClock, FakeClock, SimWorker, token_at

__all__ = ["FakeClock", "FakeWorker", "Outbox", "TimedInbox", "latency_model", "latency_profile",
           "run_loop", "token_at"]

DTYPE = "float32"


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


def latency_profile(models: Sequence[str], **round_numbers: float) -> LatencyProfile:
    """:func:`latency_model` as an instance's hello carries it (and its registry record)."""
    return msgspec.convert(latency_model(models, **round_numbers).to_dict(), LatencyProfile)


class FakeWorker(SimWorker):
    """See the module docstring; ``truth`` says what steps, prefills and switches take."""

    def __init__(
        self, truth: LatencyModel, clock: AdvancingClock | None = None, *, kind: str = "decode",
        index: int = 0, kv_region_bytes: int = 64 * 8192, slab_bytes: int = 8 * 8192,
        ttft_s: float = 1.0, tbt_s: float = 0.05, q_max_s: float = 4.0,
        round_ttft_fraction: float | None = 0.7, token_hold: float = 0.0,
        switch_s: Callable[[str, tuple[str, float] | None, float], float] | None = None,
        policy: str = "aegaeon", baseline: BaselineConfig | None = None,
    ) -> None:  # fmt: skip
        config = Config(
            models=(), dtype=DTYPE, slo=SLOConfig(ttft_s=ttft_s, tbt_s=tbt_s),
            scheduler=SchedulerConfig(policy=policy,  # type: ignore[arg-type]
                                      q_max_s=q_max_s, token_hold=token_hold,
                                      round_ttft_fraction=round_ttft_fraction),
            baseline=baseline or BaselineConfig(),
        )  # fmt: skip
        specs = {m: engine_spec(m) for m in truth.specs}
        super().__init__(
            config, kind, index, specs, truth, clock or FakeClock(),
            kv_region_bytes=kv_region_bytes, slab_bytes=slab_bytes, switch_s=switch_s,
            metrics=WorkerMetrics(f"{kind}-{index}"), logits=True,
            vocab=lambda m: self.vocabs[m],
        )  # fmt: skip
        # what the real switcher copies: the packed layout of the model's weights
        self.switcher.weight_bytes = {m: weight_layout(s, DTYPE).total_bytes
                                      for m, s in specs.items()}  # fmt: skip
        # a test that constrains decoding names a tokenizer for its models (model_vocab)
        self.vocabs: dict[str, ModelVocab] = {}

    def unit_of(self, model: str) -> str:
        return self.adapters.base_of(model) or model

    def adapt(self, name: str, base: str) -> None:
        """Serve ``name`` as a LoRA adapter of ``base``."""
        self.adapters.bases[name] = base
        self.specs[name] = self.specs[base]
        # its own bytes, what bringing it to the device costs (Eq. 4: microseconds)
        self.truth.specs[name] = replace(self.truth.spec(base), name=name,
                                         weight_bytes=1 << 16)  # fmt: skip

    def add_model(self, name: str, path: Path, base: str | None = None) -> SchedSpec:
        """A fake checkpoint: ``path``'s name is the number of layers."""
        if base is not None:
            self.adapt(name, base)
            return SchedSpec(name, 64, 128, 2, 1 << 16, 512)
        self.specs[name] = engine_spec(name, int(path.name))
        spec = SchedSpec(name, 64, 128, int(path.name), 1 << 20, 512)
        self.truth.specs[name] = spec  # what its steps take here
        self.switcher.weight_bytes[name] = weight_layout(self.specs[name], DTYPE).total_bytes
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

    def __init__(self, clock: Any, timed: Sequence[tuple[float, Any]]) -> None:
        self.clock: FakeClock = clock
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


def run_loop(loop_class: Any, worker: FakeWorker, timed: Sequence[tuple[float, Any]],
             *args: Any, **kwargs: Any) -> tuple[Any, Outbox]:  # fmt: skip
    """A ``loop_class`` (``PrefillLoop``, ``DecodeLoop``) on ``worker`` run until it idles
    with nothing left in ``timed``; its profile: a copy of the worker's true latency
    model (``loop.latency``, what it learns into)."""
    inbox, outbox = TimedInbox(worker.clock, timed), Outbox()
    estimator = LatencyModel.from_dict(worker.truth.to_dict())
    loop = loop_class(worker, inbox, outbox, *args, clock=worker.clock,
                      profile=lambda: estimator, **kwargs)  # fmt: skip
    loop.run(inbox.stop)
    return loop, outbox
