"""The fastest kernels for this machine, by measurement: per model shape, each kernel
level the CPU supports is timed on the model's own shapes and the fastest is used,
per operation.

A CPU's flags say which levels it *can* run, not which is fastest: on an AMD
Zen 5 the AVX2 decode projection beats the AVX-512 one, and whether a bfloat16
prefill GEMM is faster widened to float32 or in torch's bfloat16 depends on the
CPU's bfloat16 arithmetic. So an engine measures, once per machine:

- ``decode_projection``: every supported level and ``torch``, timed on a
  layer's four projections and the output layer at batch 1 and 8, the weights
  cycled through as many copies as the model streams a token (up to 64 MiB);
- ``prefill_gemm`` (bfloat16 weights): ``float32`` (weights widened a block of
  rows at a time) and ``bfloat16`` (torch's matmul), on the same projections
  over 128 tokens;
- ``attention``: every supported level and ``torch``, paged decode attention of
  8 sequences of 256 tokens.

Candidates are timed interleaved (a noisy neighbour hurts all alike), the
median of several rounds (one for a candidate 1.5x slower than the best after
the first); the default (the highest level, the CPU's own
bfloat16 rule) is kept unless another candidate is at least 5% faster, so
noise does not flip a choice. The result is kept beside the start-up profiles
(``$XDG_CACHE_HOME/aegaeon/profiles/kernels-<key>.json``), keyed by the CPU,
torch (and its ISA caps), the kernels' code, the thread count, the dtype and the shapes; the
first process to finish measuring writes it and every later one (and any
measuring at the same time) uses that file, so all instances of a machine
run the same kernels. ``AEGAEON_ISA`` (or ``Engine(isa=...)``) forces one
level for every operation and measures nothing; ``AEGAEON_PROFILE_CACHE=0``
measures every time and keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .attention import Attention
from .kernels import NativeOps, project_widened
from .model import KVViews, LayerOps
from .spec import ModelSpec

OPERATIONS = ("decode_projection", "prefill_gemm", "attention")
TORCH = "torch"
MARGIN = 0.95  # another candidate replaces the default only when at least 5% faster
ROUNDS = 5
DROP = 1.5  # after one round, a candidate this much slower than the best is timed no more
_STREAM_BYTES = 64 << 20  # weights a timed decode projection cycles through, at most
_PREFILL_TOKENS = 128
_DECODE_BATCHES = (1, 8)
_ATTENTION_SHAPE = (8, 256)  # sequences, context length
_TIMED_SOURCES = ("tuning.py", "kernels.py", "attention.py", "model.py", "native.py")


@dataclass(frozen=True)
class KernelChoice:
    """What runs each operation: a level (``avx2`` ...) or ``torch`` for the decode
    projection and attention; ``float32`` or ``bfloat16`` arithmetic for the prefill
    GEMM of bfloat16 weights (``float32`` for float32 weights). ``timings_us``: per
    operation, the µs measured per candidate (empty when nothing was measured)."""

    decode_projection: str
    prefill_gemm: str
    attention: str
    timings_us: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)

    def report(self) -> dict[str, dict[str, Any]]:
        """``{operation: {"level": chosen, "us": {candidate: µs}}}`` (bench JSON)."""
        return {op: {"level": getattr(self, op), "us": dict(self.timings_us.get(op, {}))}
                for op in OPERATIONS}

    def to_json(self) -> str:
        return json.dumps({"choice": {op: getattr(self, op) for op in OPERATIONS},
                           "timings_us": self.timings_us}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KernelChoice:
        """The choice of ``to_json`` (ValueError/KeyError/TypeError on a bad file)."""
        data = json.loads(text)
        choice = {op: str(data["choice"][op]) for op in OPERATIONS}
        timings = {str(op): {str(k): float(v) for k, v in per.items()}
                   for op, per in dict(data.get("timings_us", {})).items()}
        return cls(**choice, timings_us=timings)


def shape_key(spec: ModelSpec, dtype: torch.dtype) -> tuple[object, ...]:
    """What a choice depends on of a model: its projection and attention shapes, dtype."""
    return (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, spec.vocab_size, spec.qkv_bias, str(dtype))


def _weights(spec: ModelSpec, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random weights of the model's projection shapes: as many copies of a layer's four
    as the model streams per token (up to ``_STREAM_BYTES``), and the output layer."""
    g = torch.Generator().manual_seed(0)
    shapes = [((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, spec.hidden_size),
              (spec.hidden_size, spec.q_size), (2 * spec.intermediate_size, spec.hidden_size),
              (spec.hidden_size, spec.intermediate_size)]
    layer_bytes = sum(o * i for o, i in shapes) * dtype.itemsize
    copies = max(1, min(spec.num_layers, _STREAM_BYTES // max(1, layer_bytes)))

    def make(o: int, i: int) -> torch.Tensor:
        return (torch.rand(o, i, generator=g) - 0.5).mul_(i ** -0.5).to(dtype)

    rows = min(spec.vocab_size, max(1, _STREAM_BYTES // 4 // (spec.hidden_size * dtype.itemsize)))
    return [make(o, i) for _ in range(copies) for o, i in shapes], make(rows, spec.hidden_size)


def _inputs(weights: list[torch.Tensor], rows: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    dtype = weights[0].dtype
    return {w.shape[1]: torch.randn(rows, w.shape[1], generator=g).to(dtype) for w in weights}


def _timed(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median µs per candidate over ``ROUNDS`` interleaved rounds, after one warm-up call;
    a candidate over ``DROP`` times the best after the first round is timed no further
    (it cannot win: its one time is reported)."""
    for fn in candidates.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    running = dict(candidates)
    for round_ in range(ROUNDS):
        for name, fn in running.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e6)
        if round_ == 0:
            best = min(s[0] for s in samples.values())
            running = {n: fn for n, fn in running.items() if samples[n][0] <= DROP * best}
    return {name: round(statistics.median(s), 1) for name, s in samples.items()}


def _pick(timings: dict[str, float], default: str) -> str:
    best = min(timings, key=timings.__getitem__)
    return best if timings[best] < MARGIN * timings[default] else default


def _projection_ops(levels: tuple[str, ...]) -> dict[str, LayerOps]:
    """Each level's layer ops that loads, and torch's."""
    from .kernels import layer_ops

    cpu = torch.device("cpu")
    ops = {name: layer_ops(cpu, isa=name) for name in levels}
    return {**{n: o for n, o in ops.items() if isinstance(o, NativeOps)}, TORCH: LayerOps()}


def measure(spec: ModelSpec, dtype: torch.dtype, levels: tuple[str, ...],
            default: KernelChoice) -> KernelChoice:
    """Time every candidate of every operation (see the module docstring)."""
    weights, head = _weights(spec, dtype)
    timings: dict[str, dict[str, float]] = {}
    ops = _projection_ops(levels)

    def decode_with(layer_ops: LayerOps) -> Callable[[], object]:
        batches = [(_inputs(weights, rows), _inputs([head], rows)) for rows in _DECODE_BATCHES]

        def run() -> None:
            for xs, hx in batches:
                for w in weights:
                    layer_ops.project(w, xs[w.shape[1]], None)
                layer_ops.project(head, hx[head.shape[1]], None)
        return run

    with torch.inference_mode():
        timings["decode_projection"] = _timed({name: decode_with(o) for name, o in ops.items()})
        if dtype == torch.bfloat16:
            per_layer = weights[:4]
            xs = _inputs(per_layer, _PREFILL_TOKENS)
            torch_ops = LayerOps()

            def prefill_widened() -> None:
                for w in per_layer:
                    project_widened(w, xs[w.shape[1]], None)

            def prefill_bf16() -> None:
                for w in per_layer:
                    torch_ops.project(w, xs[w.shape[1]], None)

            timings["prefill_gemm"] = _timed({"float32": prefill_widened,
                                              "bfloat16": prefill_bf16})
        timings["attention"] = _timed(_attention_runs(spec, dtype, levels))
    return KernelChoice(
        decode_projection=_pick(timings["decode_projection"], default.decode_projection),
        prefill_gemm=(_pick(timings["prefill_gemm"], default.prefill_gemm)
                      if "prefill_gemm" in timings else default.prefill_gemm),
        attention=_pick(timings["attention"], default.attention),
        timings_us=timings)


def _attention_runs(spec: ModelSpec, dtype: torch.dtype,
                    levels: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    """One layer's paged decode attention per candidate, over the same random KV."""
    batch, context = _ATTENTION_SHAPE
    one_layer = replace(spec, num_layers=1)
    block = 16
    per_seq = -(-(context + 1) // block)
    block_bytes = dtype.itemsize * 2 * block * spec.kv_size
    region = torch.empty(batch * per_seq * block_bytes, dtype=torch.uint8)
    kv = KVViews.over(region, one_layer, block, dtype)
    g = torch.Generator().manual_seed(1)
    kv.cache.copy_(torch.randn(kv.cache.shape, generator=g).to(dtype))
    table = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq)
    lengths = [context + 1] * batch
    lens = torch.tensor(lengths)
    heads = spec.num_heads + 2 * spec.num_kv_heads
    qkv = torch.randn(batch, heads, spec.head_dim, generator=g).to(dtype)
    runs: dict[str, Callable[[], object]] = {}
    cpu = torch.device("cpu")
    for name in (*levels, TORCH):
        attention = Attention(cpu, native=False) if name == TORCH else Attention(cpu, isa=name)
        if name != TORCH and attention.native is None:
            continue
        attend = attention.paged_decode(kv, spec.num_heads, table, lens, lengths)
        runs[name] = _bind_attend(attend, qkv)
    return runs


def _bind_attend(attend: Callable[[int, torch.Tensor], torch.Tensor],
                 qkv: torch.Tensor) -> Callable[[], object]:
    return lambda: attend(0, qkv)


def _kernels_digest() -> str:
    """The sources whose change changes what is timed: the kernels and their callers."""
    from pathlib import Path

    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("csrc/*"), *(root / f for f in _TIMED_SOURCES)]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def choice_key(spec: ModelSpec, dtype: torch.dtype, levels: tuple[str, ...]) -> str:
    """The kept file's key: machine, torch (and its caps), code, threads, shapes, levels."""
    import os

    from aegaeon_common.kept import cpu_identity

    parts = {
        "machine": cpu_identity(),
        "torch": torch.__version__,
        "aten": torch.backends.cpu.get_cpu_capability(),
        "caps": [os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                             "ATEN_CPU_CAPABILITY")],
        "code": _kernels_digest(),
        "threads": torch.get_num_threads(),
        "shape": shape_key(spec, dtype),
        "levels": levels,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _valid(choice: KernelChoice, levels: tuple[str, ...]) -> KernelChoice:
    """``choice`` if this machine can run it (ValueError naming what it cannot)."""
    for op in ("decode_projection", "attention"):
        if getattr(choice, op) not in (*levels, TORCH):
            raise ValueError(f"{op} {getattr(choice, op)!r} is not a level of this CPU")
    if choice.prefill_gemm not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"prefill_gemm {choice.prefill_gemm!r} is not a dtype")
    return choice


def choose(spec: ModelSpec, dtype: torch.dtype, levels: tuple[str, ...],
           default: KernelChoice) -> KernelChoice:
    """The kept choice for this machine and shape, else :func:`measure` it and keep it
    (the first process to keep one wins; ``AEGAEON_PROFILE_CACHE=0``: measure, keep
    nothing)."""
    import logging

    from aegaeon_common.env import read_env
    from aegaeon_common.kept import write_first

    log = logging.getLogger(__name__)
    env = read_env()
    if not env.profile_cache:
        return measure(spec, dtype, levels, default)
    path = env.cache_dir / "profiles" / f"kernels-{choice_key(spec, dtype, levels)}.json"
    try:
        return _valid(KernelChoice.from_json(path.read_text()), levels)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kept kernel choice %s unreadable (%s), measuring again", path, exc)
        path.unlink(missing_ok=True)
    choice = measure(spec, dtype, levels, default)
    try:
        kept = KernelChoice.from_json(write_first(path, choice.to_json()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kernel choice not kept (%s): %s", path, exc)
        return choice
    log.info("kernels for %s (%s): %s", spec.name, dtype,
             ", ".join(f"{op} {getattr(kept, op)}" for op in OPERATIONS))
    return kept
