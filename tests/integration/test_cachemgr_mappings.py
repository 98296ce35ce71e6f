"""Model mappings kept by the client across pins, dropped on eviction; noted uses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aegaeon_engine.layout import weight_layout
from aegaeon_engine.spec import ModelSpec
from aegaeon_runtime.cacheclient.client import CacheClient
from cachemgr_harness import CacheMgrProcess, checkpoint, shm_segments, write_config


@pytest.fixture
def cm(tmp_path: Path) -> Iterator[CacheMgrProcess]:
    paths = {"a": checkpoint(0), "b": checkpoint(1), "c": checkpoint(2)}
    size = weight_layout(ModelSpec.from_dir(paths["a"]), "bfloat16").total_bytes
    proc = CacheMgrProcess(write_config(tmp_path, paths, model_cache=int(2.5 * size))).start()
    yield proc
    assert proc.stop() == 0, proc.log()
    assert shm_segments(proc.prefix) == []


async def test_mapping_outlives_the_pin_and_goes_with_eviction(cm: CacheMgrProcess) -> None:
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    assert client.cached_model("a") is None  # never loaded
    model = await client.load_model("a")
    expected = model.data.clone()
    assert await client.unpin("a") == 0
    kept = client.cached_model("a")  # no round trip, no pin
    assert kept is not None and kept.region is model.region and not kept.region.closed
    assert torch.equal(kept.data, expected)
    again = await client.load_model("a", pin=False)
    assert again.region is model.region  # the same mapping, not mapped again

    data = kept.data
    await client.load_model("b", pin=False)
    await client.load_model("c", pin=False)  # evicts a, the least recently used
    stats = await client.stats()
    assert [m.name for m in stats.model_cache.models] == ["b", "c"]
    assert client.cached_model("a") is None  # its region was unlinked
    assert torch.equal(data, expected)  # a tensor taken earlier stays readable
    reloaded = await client.load_model("a", pin=False)  # evicts b
    assert reloaded.region.name != model.region.name
    assert torch.equal(reloaded.data, expected)
    await client.close()


async def test_noted_uses_reach_the_lru_order_once(cm: CacheMgrProcess) -> None:
    client = CacheClient(cm.config.cachemgr_address, "w0", use_report_interval_s=0.05)
    client.note_use("a")  # before register: reported once the reporter runs
    await client.register()
    await client.load_model("a", pin=False)
    await client.load_model("b", pin=False)
    await asyncio.sleep(0.3)  # the early note is reported: a is most recent again
    hits = (await client.stats()).model_cache.num_hits
    client.note_use("b")
    client.note_use("a")
    client.note_use("a")  # one report per model and interval
    await asyncio.sleep(0.3)
    stats = await client.stats()
    assert stats.model_cache.num_hits == hits + 2
    assert [m.name for m in stats.model_cache.models] == ["a", "b"]  # reported in order
    client.note_use("a")
    await asyncio.sleep(0.3)
    await client.load_model("c", pin=False)  # so b, not a, is evicted
    assert [m.name for m in (await client.stats()).model_cache.models] == ["a", "c"]
    await client.close()  # stops the reporter

