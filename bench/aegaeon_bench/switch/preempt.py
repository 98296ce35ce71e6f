"""A full preemptive switch on a decode worker, broken down (paper §5, Fig. 8-10).

Model A decodes a batch (``batch`` requests x ``context`` tokens of KV on the
device); model B's batch was preempted earlier and waits in the unified CPU
KV cache. The switch, on the compute thread:

1. swap-out of A's KV (enqueued on the swap-out stream; it runs concurrently
   and is off the critical path, §5.3: only its event is kept),
2. swap-in of B's KV into fresh device blocks, enqueued on the swap-in
   stream behind the event of B's own earlier swap-out, so it overlaps the
   scale-up (§5.3, Fig. 10; ``overlap=False`` issues it after the scale-up),
3. scale-up of B (``ModelSwitcher.activate``), then a wait for the swap-in
   event, since B's first decode step needs its KV (rule 1).

The critical path runs from 1 until the scale-up is done and the swap-in
event completed; ``swap_in_ms`` is the swap-in's share of it (enqueueing,
and the wait after the scale-up). With prefetch on,
``ModelSwitcher.prefetch(B)`` starts as A's decode turn starts (``slice_s``
of real decode steps of A's batch), so the scale-up only binds views when
the background copy finished in time; the decode steps taken during the
prefetch, against those of the prefetch-off run, show what the background
copy costs the running model on this 2-core machine.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from aegaeon_engine import DecodeSeq, KVShape
from aegaeon_runtime.worker import Worker


@dataclass
class SwitchSamples:
    """Milliseconds per trial of one (A -> B) switch with prefetch on or off."""

    swap_out_ms: list[float] = field(default_factory=list)  # enqueueing on the critical path
    swap_out_done_ms: list[float] = field(default_factory=list)  # its copy done, from t0
    scale_up_ms: list[float] = field(default_factory=list)
    scale_up_copy_ms: list[float] = field(default_factory=list)  # its copy (0 if prefetched)
    swap_in_ms: list[float] = field(default_factory=list)
    total_ms: list[float] = field(default_factory=list)
    prefetched: list[bool] = field(default_factory=list)
    prefetch_copy_ms: list[float] = field(default_factory=list)  # the background copy
    decode_step_ms: list[float] = field(default_factory=list)  # every step of A's slice
    # prefetch on: the steps that started while the background copy ran
    decode_step_overlap_ms: list[float] = field(default_factory=list)

    def medians(self) -> dict[str, float | None]:
        """Median of every timing (ms), plus the share of trials that used the prefetch."""
        timings = (f.name for f in fields(self) if f.name != "prefetched")
        out: dict[str, float | None] = {
            key: round(statistics.median(values), 3) if (values := getattr(self, key)) else None
            for key in timings
        }
        out["prefetched_share"] = sum(self.prefetched) / max(len(self.prefetched), 1)
        return out


@dataclass(frozen=True)
class Batch:
    """Requests of one model: their KV blocks on the device, or in the CPU cache."""

    model: str
    shape: KVShape
    blocks_per_seq: int
    num_seqs: int


def _decode_slice(worker: Worker, batch: Batch, blocks: list[int], context: int,
                  slice_s: float) -> list[tuple[float, float]]:
    """Real decode steps of ``batch`` (at ``context``) for ``slice_s`` (at least one):
    (start from the slice's start, duration) of each, seconds."""
    n = batch.blocks_per_seq
    seqs = [DecodeSeq(1, context - 1, blocks[i * n:(i + 1) * n]) for i in range(batch.num_seqs)]
    steps = []
    origin = time.perf_counter()
    deadline = origin + slice_s
    while True:
        start = time.perf_counter()
        worker.engine.decode(seqs)
        if worker.engine.device.type == "cuda":  # a step ends when its kernels do
            torch.cuda.synchronize(worker.engine.device)
        end = time.perf_counter()
        steps.append((start - origin, end - start))
        if end >= deadline:
            return steps


def one_switch(worker: Worker, a: Batch, b: Batch, context: int, prefetch: bool,
               slice_s: float, out: SwitchSamples, overlap: bool = True) -> None:
    """Set up A decoding and B preempted, switch A -> B once, record, free everything."""
    kv, switcher = worker.kv, worker.switcher
    if switcher.active_model == a.model or switcher.prefetched_model() is not None:
        switcher.activate(b.model)  # settles a pending prefetch
    switcher.activate(a.model)  # from the cache to offset 0: B fits after it
    host_b, event_b = kv.swap_out(b.shape, kv.alloc(b.shape, b.blocks_per_seq * b.num_seqs))
    event_b.wait()
    blocks_a = kv.alloc(a.shape, a.blocks_per_seq * a.num_seqs)
    if prefetch and not switcher.prefetch(b.model):
        raise RuntimeError(f"could not prefetch {b.model!r} after {a.model!r}: arena too small")
    steps = _decode_slice(worker, a, blocks_a, context, slice_s)

    t0 = time.perf_counter()
    host_a, event_a = kv.swap_out(a.shape, blocks_a)
    t1 = time.perf_counter()
    if overlap:
        blocks_b = kv.alloc(b.shape, b.blocks_per_seq * b.num_seqs)
        event_in = kv.swap_in(b.shape, host_b, blocks_b, after=event_b)
    t2 = time.perf_counter()
    record = switcher.activate(b.model)
    t3 = time.perf_counter()
    if not overlap:
        blocks_b = kv.alloc(b.shape, b.blocks_per_seq * b.num_seqs)
        event_in = kv.swap_in(b.shape, host_b, blocks_b, after=event_b)
    event_in.wait()
    t4 = time.perf_counter()
    event_a.wait()
    t5 = time.perf_counter()

    out.swap_out_ms.append((t1 - t0) * 1e3)
    out.scale_up_ms.append((t3 - t2) * 1e3)
    out.swap_in_ms.append((t2 - t1 + t4 - t3) * 1e3)
    out.total_ms.append((t4 - t0) * 1e3)
    out.swap_out_done_ms.append((t5 - t0) * 1e3)
    prefetched = record is not None and record.prefetched
    out.prefetched.append(prefetched)
    out.scale_up_copy_ms.append(0.0 if prefetched or record is None else record.load_s * 1e3)
    out.decode_step_ms.extend(d * 1e3 for _, d in steps)
    if prefetched and record is not None:
        out.prefetch_copy_ms.append(record.load_s * 1e3)
        out.decode_step_overlap_ms.extend(d * 1e3 for s, d in steps if s < record.load_s)
    kv.free(b.shape, blocks_b)
    kv.free_host(host_a, None)
    kv.free_host(host_b, None)


def batch_of(worker: Worker, model: str, num_seqs: int, context: int) -> Batch:
    """``num_seqs`` requests of ``model`` with ``context`` tokens of KV each."""
    shape = worker.kv_shape(model)
    return Batch(model, shape, shape.blocks_for(context), num_seqs)


def measure_switches(worker: Worker, names: list[str], num_seqs: int, context: int,
                     slice_s: float, repeats: int) -> dict[str, dict[str, Any]]:
    """Per model B (A = the model before it in ``names``): ``repeats`` switches A -> B
    with prefetch off and as many with it on, alternating; the medians of each."""
    rows: dict[str, dict[str, Any]] = {}
    for i, b in enumerate(names):
        a = names[i - 1]
        batch_a = batch_of(worker, a, num_seqs, context)
        batch_b = batch_of(worker, b, num_seqs, context)
        samples = {False: SwitchSamples(), True: SwitchSamples()}
        for trial in range(2 * repeats):
            prefetch = (trial + i) % 2 == 1
            one_switch(worker, batch_a, batch_b, context, prefetch, slice_s, samples[prefetch])
        rows[b] = {
            "switch_from": a,
            "kv_batch_bytes": batch_b.shape.block_bytes * batch_b.blocks_per_seq * num_seqs,
            "switch_off": samples[False].medians(),
            "switch_on": samples[True].medians(),
        }
    return rows
