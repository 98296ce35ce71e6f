"""LoRA adapters on a worker's device (aegaeon_runtime.adapters), through a real cachemgr.

The Model Cache holds each adapter's packed matrices beside its base's. A copying
worker copies an adapter into its device buffer's adapter region (the bytes equal
the adapter's tensors in the serving dtype); a mapped one binds views over the
Model Cache region, copying nothing. A region too small for a step's adapters
takes those that fit and the rest wait; a later step gets them by refilling the
region, dropping the adapters it held. A step that mixes the base and its
adapters gives each row the tokens it gets alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aegaeon_bench.switch.rig import Rig, RigSizes, switch_rig
from aegaeon_engine import DecodeSeq
from aegaeon_engine.lora import LoraStacks
from aegaeon_engine.lora_spec import adapter_layout
from aegaeon_runtime.adapters import AdapterResidency
from lora_support import lora_market

MiB = 1 << 20
BASE = "llama-gqa-5m"
ADAPTERS = ("tune-a", "tune-b", "tune-c")
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def adapter_dirs(default_market: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Path]:  # fmt: skip
    from aegaeon_market.adapters import add_random_adapter

    root = lora_market(tmp_path_factory.mktemp("residency") / "m", {BASE: default_market / BASE})
    return {name: add_random_adapter(root, name, BASE, 16, seed=k).path
            for k, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def rig(default_market: Path, adapter_dirs: dict[str, Path]) -> Iterator[Rig]:
    sizes = RigSizes(model_cache_bytes=128 * MiB, kv_cache_bytes=64 * MiB, slab_bytes=4 * MiB,
                     device_memory_bytes=(64 + 32) * MiB, kv_memory_bytes=32 * MiB)
    models = {BASE: default_market / BASE, **adapter_dirs}
    with switch_rig(models, "bfloat16", sizes, weights="copy",
                    bases=dict.fromkeys(ADAPTERS, BASE)) as running:  # fmt: skip
        yield running


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_a_copying_worker_copies_adapters_into_its_region(rig: Rig,
                                                          adapter_dirs: dict[str, Path]) -> None:
    worker = rig.worker
    region = worker.adapters.region
    assert region is not None and region.numel() == worker.buffer.adapter_region.numel()
    worker.switcher.activate(BASE)
    weights = worker.adapters.for_step(["tune-a", None, "tune-b"])
    assert weights[1] is None
    start, end = region.data_ptr(), region.data_ptr() + region.numel()
    for name, w in zip(("tune-a", "tune-b"), (weights[0], weights[2]), strict=True):
        assert w is not None and w.name == name
        tensors = _file_tensors(adapter_dirs[name])
        a, b = w.layers[0]["q"]
        assert start <= a.data_ptr() < end and start <= b.data_ptr() < end
        prefix = w.spec.prefix + "layers.0.self_attn.q_proj"
        assert torch.equal(a, tensors[f"{prefix}.lora_A.weight"])
        assert torch.equal(b, tensors[f"{prefix}.lora_B.weight"])
    assert set(worker.adapters.resident()) == {"tune-a", "tune-b"}
    assert "tune-a" in worker.adapters.with_adapters([BASE])


def test_a_mapped_residency_binds_over_the_model_cache(rig: Rig) -> None:
    worker = rig.worker
    mapped = AdapterResidency(worker.cache, "bfloat16", None, LoraStacks())
    mapped.specs = dict(worker.adapters.specs)
    (w,) = mapped.for_step(["tune-c"])
    assert w is not None
    region = worker.cache.load_model("tune-c", pin=True)
    try:
        start = region.data.data_ptr()
        a, _ = w.layers[1]["v"]
        assert start <= a.data_ptr() < start + region.nbytes
    finally:
        worker.cache.unpin("tune-c")


def test_a_small_region_takes_what_fits_and_refills_for_the_rest(rig: Rig) -> None:
    worker = rig.worker
    nbytes = adapter_layout(worker.adapters.specs["tune-a"], "bfloat16").total_bytes
    stacks = LoraStacks()
    small = AdapterResidency(worker.cache, "bfloat16",
                             torch.empty(2 * nbytes + 4096, dtype=torch.uint8), stacks)
    small.specs = dict(worker.adapters.specs)
    first = small.for_step(["tune-a", "tune-b", "tune-c"])
    assert [w is not None for w in first] == [True, True, False]  # the third waits
    second = small.for_step(["tune-c"])
    assert second[0] is not None and small.resident() == ["tune-c"]
    assert small.num_loads == 3


def test_a_mixed_step_gives_every_row_its_own_tokens(rig: Rig) -> None:
    worker = rig.worker
    engine = worker.engine
    worker.switcher.activate(BASE)
    shape = worker.kv_shape(BASE)

    def greedy(rows: list[str | None], steps: int = 6) -> list[list[int]]:
        weights = worker.adapters.for_step(rows)
        blocks = [worker.kv.alloc(shape, shape.blocks_for(len(PROMPT) + steps)) for _ in rows]
        try:
            out = [[int(engine.prefill(PROMPT, b, adapter=w).argmax())]
                   for b, w in zip(blocks, weights, strict=True)]
            for k in range(steps - 1):
                seqs = [DecodeSeq(o[-1], len(PROMPT) + k, b, w)
                        for o, b, w in zip(out, blocks, weights, strict=True)]
                for o, logits in zip(out, engine.decode(seqs), strict=True):
                    o.append(int(logits.argmax()))
            return out
        finally:
            for b in blocks:
                worker.kv.free(shape, b)

    rows: list[str | None] = [None, "tune-a", "tune-b", "tune-c"]
    alone = [greedy([name])[0] for name in rows]
    assert greedy(rows) == alone
