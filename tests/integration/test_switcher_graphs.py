"""The switcher with an engine that replays decode-step graphs (CUDA graphs on a GPU; here
the eager capturer, which runs the same static step and keeps the same books).

A graph replays the bytes at the address it was captured over, so a switch
copies a model to where its graphs are when that place is free: after the
start-up capture (every model's layout at offset 0) and one A -> B -> A round
trip, switching back and forth captures nothing more; every turn's greedy
tokens are an eager engine's on the same bytes, and the stats say so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from aegaeon_bench.switch.rig import Rig, RigSizes, switch_rig
from aegaeon_engine import DecodeSeq, Engine
from aegaeon_engine.cuda_graphs import EagerCapturer

MiB = 1 << 20
A, B = "llama-gqa-5m", "mistral-11m"
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def rig(default_market: Path) -> Iterator[Rig]:
    sizes = RigSizes(model_cache_bytes=128 * MiB, kv_cache_bytes=64 * MiB, slab_bytes=4 * MiB,
                     device_memory_bytes=(58 + 32) * MiB, kv_memory_bytes=32 * MiB)
    with switch_rig({A: default_market / A, B: default_market / B}, "bfloat16",
                    sizes) as running:
        graphs = Engine("cpu", native=False, graphs=True, capturer=EagerCapturer())
        running.worker.engine = graphs
        running.worker.switcher.engine = graphs
        yield running


def _greedy(rig: Rig, engine: Engine, n: int = 8) -> list[int]:
    w = rig.worker
    model = w.switcher.active_model
    assert model is not None and w.switcher.active is not None
    if engine is not w.engine:  # the reference: an eager engine over the same bytes
        engine.bind(w.specs[model], w.switcher.active.weights, w.buffer.kv_region)
    shape = w.kv_shape(model)
    blocks = w.kv.alloc(shape, shape.blocks_for(len(PROMPT) + n))
    try:
        out = [int(engine.prefill(PROMPT, blocks).argmax())]
        for i in range(n - 1):
            logits = engine.decode([DecodeSeq(out[-1], len(PROMPT) + i, blocks)])
            out.append(int(logits[0].argmax()))
        return out
    finally:
        w.kv.free(shape, blocks)


def test_graph_switches_land_where_the_graphs_are(rig: Rig) -> None:
    w, switcher = rig.worker, rig.worker.switcher
    eager = Engine("cpu", native=False)
    w.capture_graphs([A, B])  # start-up: each layout at offset 0
    stats = w.engine.graph_stats
    assert stats.enabled and stats.slots == 2
    switcher.activate(A)
    assert switcher.active is not None and switcher.active.allocation is not None
    assert switcher.active.allocation.offset == 0
    want_a = _greedy(rig, eager)
    assert _greedy(rig, w.engine) == want_a
    captured = stats.captures
    offsets: dict[str, set[int]] = {A: set(), B: set()}
    for name in (B, A, B, A, B):
        assert switcher.prefetch(name)
        record = switcher.activate(name)
        assert record is not None and record.prefetched
        assert switcher.active is not None and switcher.active.allocation is not None
        offsets[name].add(switcher.active.allocation.offset)
        assert _greedy(rig, w.engine) == _greedy(rig, eager), name
    # B took one new place beside A (its own graphs there, captured at its first step);
    # from then on each model lands where its graphs are: nothing more is captured
    assert offsets[A] == {0} and len(offsets[B]) == 1
    assert stats.captures == captured + len(stats.sizes)
    assert stats.eager_steps == 0 and stats.replays > 0
