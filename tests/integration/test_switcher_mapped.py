"""The switcher with mapped weights (``decode.weights: map``): the engine reads the
Model Cache's shared memory in place, a switch copies nothing, tokens are the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aegaeon_bench.switch.check import greedy_tokens, reference_tokens
from aegaeon_bench.switch.rig import Rig, RigSizes, switch_rig
from aegaeon_gpumem.shm import ShmRegion, unique_name
from aegaeon_runtime.cacheclient.mapped import MappedModel

MiB = 1 << 20
NAMES = ["llama-gqa-5m", "mistral-11m", "qwen2-19m"]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def _sizes() -> RigSizes:
    return RigSizes(
        model_cache_bytes=256 * MiB, kv_cache_bytes=64 * MiB, slab_bytes=4 * MiB,
        device_memory_bytes=(58 + 32) * MiB, kv_memory_bytes=32 * MiB,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mapped(default_market: Path) -> Iterator[Rig]:
    with switch_rig({n: default_market / n for n in NAMES}, "bfloat16", _sizes(),
                    weights="map") as running:  # fmt: skip
        yield running


def test_mapped_weights_are_the_model_cache_region(mapped: Rig) -> None:
    switcher = mapped.worker.switcher
    record = switcher.activate("qwen2-19m")
    assert record is not None and not record.prefetched
    active = switcher.active
    assert active is not None and active.allocation is None
    weights = active.weights
    tensors = [weights.embed_tokens, weights.norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    region = mapped.worker.cache.load_model("qwen2-19m", pin=True)
    try:
        start = region.data.data_ptr()
        assert all(start <= t.data_ptr() < start + region.nbytes for t in tensors)
    finally:
        mapped.worker.cache.unpin("qwen2-19m")
    assert mapped.worker.buffer.stats().used_bytes == 0  # the arena is not used


def test_mapped_switches_give_a_fresh_engines_tokens(mapped: Rig, default_market: Path) -> None:
    switcher = mapped.worker.switcher
    got: dict[str, list[int]] = {}
    for name in ["mistral-11m", "llama-gqa-5m", "qwen2-19m", "mistral-11m"]:
        assert switcher.prefetch(name) or switcher.active_model == name
        record = switcher.activate(name)
        assert record is None or record.prefetched
        tokens = greedy_tokens(mapped.worker, PROMPT, 10)
        assert got.setdefault(name, tokens) == tokens, name  # the same after A -> B -> A
    for name, tokens in got.items():
        assert tokens == reference_tokens(default_market / name, "bfloat16", PROMPT, 10), name


def test_activating_another_model_drops_the_mapped_prefetch(mapped: Rig) -> None:
    switcher = mapped.worker.switcher
    switcher.activate("llama-gqa-5m")
    assert switcher.prefetch("qwen2-19m")
    record = switcher.activate("mistral-11m")
    assert record is not None and not record.prefetched
    assert switcher.prefetched_model() is None and switcher.active_model == "mistral-11m"


def test_views_over_an_evicted_region_are_dropped(mapped: Rig) -> None:
    switcher = mapped.worker.switcher
    switcher.activate("llama-gqa-5m")
    assert switcher.prefetch("mistral-11m")
    switcher.activate("mistral-11m")
    kept = dict(switcher._mapped_views)
    assert {"llama-gqa-5m", "mistral-11m"} <= set(kept)
    # a region the cachemgr has since unlinked (evicted), kept for a model
    owner = ShmRegion.create(unique_name("evicted-test"), 4096)
    gone = MappedModel("gone", ShmRegion.attach(owner.name, readonly=True), 4096, "bfloat16", ())
    switcher._mapped_views["gone"] = (gone, kept["llama-gqa-5m"][1])
    owner.close()  # the owner unlinks the name
    assert switcher.prefetch("qwen2-19m")  # the prefetch thread drops it
    switcher.activate("qwen2-19m")
    assert "gone" not in switcher._mapped_views
    assert {"llama-gqa-5m", "mistral-11m", "qwen2-19m"} <= set(switcher._mapped_views)
