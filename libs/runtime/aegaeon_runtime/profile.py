"""The start-up profile a worker fits its latency model from (paper App. A.2).

A few prefills and decode steps of a few market models on the real engine,
and the measured switch times, give the samples for Eq. 4-6; the services
refine the fit online from every measured step afterwards. Profiling runs on
the compute thread before serving, through the same switcher and KV space as
serving, and frees everything it used.

A decode sample is timed as a served step is (decode/turn.py): ``engine.decode``
of a batch whose sequences have *mixed* context lengths (a quarter to 1.75x
the batch's mean, as serving mixes them: the kernels take the same path, where
equal lengths would let a padded path look faster than it is), with the
engine's CUDA graphs where it has them (the warm-up step captures them), plus
the sampler; each sample is the median of ``STEP_REPEATS`` steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from aegaeon_engine import DecodeSeq, SamplingParams
from aegaeon_sched import DecodeSample, LatencyModel, PrefillSample

from aegaeon_runtime.port import ModelGoneError
from aegaeon_runtime.worker import Worker

PREFILL_LENS = (16, 64, 256)
# (batch size, mean context length); a batch's lengths are spread around the mean
DECODE_BATCHES = ((1, 32), (4, 64), (8, 256), (16, 96))
STEP_REPEATS = 5
_SAMPLING = SamplingParams()  # what a request gets by default


def mixed_contexts(batch: int, mean: int) -> list[int]:
    """``batch`` context lengths from a quarter to 1.75x ``mean`` (mean ``mean``)."""
    if batch == 1:
        return [mean]
    return [max(1, round(mean * (0.25 + 1.5 * i / (batch - 1)))) for i in range(batch)]


def served_step_s(worker: Worker, seqs: Sequence[DecodeSeq]) -> float:
    """One decode step of ``seqs`` as a turn runs it: the engine's step and the sampler."""
    def step() -> None:
        logits = worker.engine.decode(seqs)
        worker.sampler.sample(logits, [_SAMPLING] * len(seqs), [None] * len(seqs))

    return _time(worker, step)


def median_s(measure: Callable[[], float], repeats: int = STEP_REPEATS) -> float:
    return statistics.median(measure() for _ in range(repeats))


def profile_models(worker: Worker) -> list[str]:
    """Smallest, median and largest model by weight bytes (at most three) of those whose
    checkpoint could be read (none when no model could); LoRA adapters are not models
    of their own here (the switcher holds no adapters)."""
    readable = [m for m in worker.switcher.specs if m not in worker.unavailable]
    if not readable:
        return []
    by_size = sorted(readable, key=worker.switcher.nbytes)
    picks = [by_size[0], by_size[len(by_size) // 2], by_size[-1]]
    return list(dict.fromkeys(picks))


def _time(worker: Worker, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    device = worker.engine.device
    if device.type == "cuda":  # the kernels' time, not their launch
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def profile(worker: Worker, models: Sequence[str] | None = None) -> LatencyModel:
    """Measure, fit and return a latency model for every model of the worker."""
    models = list(models or profile_models(worker))
    prefills: list[PrefillSample] = []
    decodes: list[DecodeSample] = []
    switch_ratios: list[float] = []
    bandwidth = 0.0
    for model in models:
        try:
            record = worker.switcher.activate(model)
        except ModelGoneError:  # unreadable since the worker started: measure the others
            continue
        if record is not None and record.load_s > 0:
            nbytes = worker.switcher.nbytes(model)
            bandwidth = max(bandwidth, nbytes / record.load_s)
            switch_ratios.append(record.total_s / record.load_s)
        shape = worker.kv_shape(model)
        limit = worker.max_model_len(model)
        for length in PREFILL_LENS:
            if length > limit:
                continue
            blocks = worker.kv.alloc(shape, shape.blocks_for(length))
            try:
                tokens = [1] * length
                worker.engine.prefill(tokens, blocks)  # warm-up of this shape
                seconds = _time(worker, lambda: worker.engine.prefill(tokens, blocks))  # noqa: B023
                prefills.append(PrefillSample(model, (length,), seconds))
            finally:
                worker.kv.free(shape, blocks)
        for batch, mean in DECODE_BATCHES:
            contexts = mixed_contexts(batch, mean)
            if max(contexts) + 1 > limit:
                continue
            per_seq = [shape.blocks_for(c + 1) for c in contexts]
            blocks = worker.kv.alloc(shape, sum(per_seq))
            try:
                starts = [sum(per_seq[:i]) for i in range(batch)]
                seqs = [DecodeSeq(1, ctx, blocks[first:first + n])
                        for ctx, n, first in zip(contexts, per_seq, starts, strict=True)]
                served_step_s(worker, seqs)  # warm-up (and a graph capture where there are)
                seconds = median_s(lambda: served_step_s(worker, seqs))  # noqa: B023
                decodes.append(DecodeSample(model, batch, sum(c + 1 for c in contexts),
                                            seconds))
            finally:
                worker.kv.free(shape, blocks)
    latency = LatencyModel(
        [worker.sched_spec(m) for m in worker.switcher.specs],
        pcie_bytes_per_s=bandwidth or 5e9,
        switch_beta=statistics.median(switch_ratios) if switch_ratios else 1.0,
        decode_per_seq_term=True,
    )
    latency.fit_prefill(prefills)
    latency.fit_decode(decodes)
    return latency
