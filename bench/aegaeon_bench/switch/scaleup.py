"""Scale-up from the Model Cache against a plain memory copy of the same bytes.

For each model, each round: ``ModelSwitcher.activate(model)`` from the model
before it (no prefetch: the reset bump pointer, the copy from the warm Model
Cache, binding) and a plain ``memcpy`` of the model's byte count between two
resident process buffers, the limit of this machine. The two alternate in
order from round to round, so a noisy neighbour hurts both alike. The first
activation of each model in the worker (its region mapped for the first
time) is reported apart as ``first_scale_up_ms``. ``bind_ms`` is what
building the model's weight views costs (the switcher keeps them per arena
offset, so a scale-up to a place seen before skips it) and
``engine_bind_ms`` what ``Engine.bind`` costs on every switch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from aegaeon_engine import bind_weights
from aegaeon_gpumem import byte_copy
from aegaeon_runtime.switcher import ModelSwitcher

BIND_REPEATS = 20


@dataclass
class ScaleUpSamples:
    """Seconds per round for one model."""

    nbytes: int
    first_s: float = 0.0
    bind_s: float = 0.0
    engine_bind_s: float = 0.0
    scale_up_s: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ScaleUpRow:
    """Medians for one model (ms, GB/s) and their ratio."""

    model: str
    nbytes: int
    first_scale_up_ms: float
    scale_up_ms: float
    copy_ms: float
    overhead_ms: float
    bind_ms: float
    engine_bind_ms: float
    memcpy_ms: float
    scale_up_gb_s: float
    memcpy_gb_s: float
    load_over_memcpy: float


def _gb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def plain_kind(device: str) -> str:
    """What :class:`PlainCopy` measures on ``device``."""
    return "pinned host -> device" if device.startswith("cuda") else "host memcpy"


class PlainCopy:
    """Two resident buffers of ``nbytes`` for the memcpy baseline (touched at creation).

    On a CUDA ``device`` the baseline is the link's limit: a page-locked host
    buffer copied to device memory (one DMA, timed to its completion).
    """

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        self.cuda = device.startswith("cuda")
        self.src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def time(self, nbytes: int) -> float:
        """Seconds of one memcpy of ``nbytes``."""
        start = time.perf_counter()
        if self.cuda:
            self.dst[:nbytes].copy_(self.src[:nbytes], non_blocking=True)
            torch.cuda.synchronize(self.dst.device)
        else:
            byte_copy(self.dst[:nbytes], self.src[:nbytes])
        return time.perf_counter() - start


def _activate(switcher: ModelSwitcher, name: str) -> tuple[float, float]:
    record = switcher.activate(name)
    if record is None:
        raise RuntimeError(f"{name!r} was already active: nothing was scaled up")
    if record.prefetched:
        raise RuntimeError(f"{name!r} came from a prefetch: not a scale-up from the cache")
    return record.total_s, record.load_s


def measure_scale_ups(
    switcher: ModelSwitcher, names: Sequence[str], repeats: int, plain: PlainCopy
) -> dict[str, ScaleUpSamples]:
    """Interleaved scale-up and memcpy samples for every model (see module docstring)."""
    if len(names) < 2:
        raise ValueError("the switch bench needs at least two models")
    samples = {n: ScaleUpSamples(switcher.nbytes(n)) for n in names}
    if switcher.active_model in names:
        switcher.activate(names[(names.index(switcher.active_model) + 1) % len(names)])
    for name in names:  # first activations: regions mapped for the first time
        if switcher.active_model == name:
            switcher.activate(names[(names.index(name) + 1) % len(names)])
        samples[name].first_s = _activate(switcher, name)[0]
    for round_index in range(repeats):
        for name in names:
            sample = samples[name]
            if switcher.active_model == name:
                switcher.activate(names[(names.index(name) + 1) % len(names)])
            memcpy_first = (round_index + names.index(name)) % 2 == 0
            if memcpy_first:
                sample.memcpy_s.append(plain.time(sample.nbytes))
            total_s, load_s = _activate(switcher, name)
            sample.scale_up_s.append(total_s)
            sample.copy_s.append(load_s)
            if not memcpy_first:
                sample.memcpy_s.append(plain.time(sample.nbytes))
    for name in names:
        samples[name].bind_s, samples[name].engine_bind_s = measure_bind(switcher, name)
    return samples


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bind(switcher: ModelSwitcher, name: str) -> tuple[float, float]:
    """Seconds to build ``name``'s weight views, and of ``Engine.bind`` (it is activated)."""
    switcher.activate(name)
    active = switcher.active
    assert active is not None and active.allocation is not None  # the rig copies
    spec = switcher.specs[name]
    layout = switcher.engine.layout(spec, switcher.dtype)
    view = switcher.buffer.view(active.allocation.offset, active.allocation.nbytes)
    kv_region = switcher.buffer.kv_region
    views_s = _median_time(lambda: bind_weights(spec, layout, view), BIND_REPEATS)
    engine_s = _median_time(lambda: switcher.engine.bind(spec, active.weights, kv_region),
                            BIND_REPEATS)
    return views_s, engine_s


def scale_up_rows(samples: dict[str, ScaleUpSamples]) -> list[ScaleUpRow]:
    """Medians per model; ``load_over_memcpy`` = memcpy time / scale-up time."""
    rows = []
    for name, s in samples.items():
        scale_up = statistics.median(s.scale_up_s)
        copy = statistics.median(s.copy_s)
        memcpy = statistics.median(s.memcpy_s)
        rows.append(ScaleUpRow(
            model=name, nbytes=s.nbytes, first_scale_up_ms=s.first_s * 1e3,
            scale_up_ms=scale_up * 1e3, copy_ms=copy * 1e3, overhead_ms=(scale_up - copy) * 1e3,
            bind_ms=s.bind_s * 1e3, engine_bind_ms=s.engine_bind_s * 1e3,
            memcpy_ms=memcpy * 1e3, scale_up_gb_s=_gb_s(s.nbytes, scale_up),
            memcpy_gb_s=_gb_s(s.nbytes, memcpy),
            load_over_memcpy=memcpy / scale_up if scale_up > 0 else 0.0,
        ))  # fmt: skip
    return rows
