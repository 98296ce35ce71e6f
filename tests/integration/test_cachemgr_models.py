"""The Model Cache through a real cachemgr process: layout bytes, LRU and pins, errors."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_common.messages.cache import CacheStats
from aegaeon_common.transport import RemoteError
from aegaeon_engine.layout import weight_layout
from aegaeon_engine.loader import fill_layout
from aegaeon_engine.spec import ModelSpec
from aegaeon_runtime.cacheclient.client import CacheClient
from cachemgr_harness import CacheMgrProcess, checkpoint, shm_segments, write_config

Start = Callable[..., CacheMgrProcess]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    procs: list[CacheMgrProcess] = []

    def _start(models: dict[str, Path], **kwargs: Any) -> CacheMgrProcess:
        proc = CacheMgrProcess(write_config(tmp_path, models, **kwargs)).start()
        procs.append(proc)
        return proc

    yield _start
    for proc in procs:
        assert proc.stop() == 0, proc.log()
        assert shm_segments(proc.prefix) == []


def resident(stats: CacheStats) -> dict[str, int]:
    return {m.name: m.pins for m in stats.model_cache.models}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_region_bytes_are_the_engine_layout(start: Start, dtype: str) -> None:
    path = checkpoint(0)
    cm = start({"a": path}, dtype=dtype)
    layout = weight_layout(ModelSpec.from_dir(path), dtype)
    expected = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_layout(path, layout, expected)
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    model = await client.load_model("a")
    assert not model.hit and model.load_s > 0
    assert model.dtype == dtype and model.nbytes == layout.total_bytes
    assert model.region.readonly
    assert torch.equal(model.data, expected)
    assert [(t.name, t.offset, t.nbytes, tuple(t.shape)) for t in model.tensors] == [
        (s.name, s.offset, s.nbytes, s.shape) for s in layout.slots
    ]
    assert model.view("norm").dtype == getattr(torch, dtype)
    again = await client.load_model("a")
    assert again.hit and again.region is model.region  # cached attachment
    stats = await client.stats()
    assert resident(stats) == {"a": 2}
    assert stats.model_cache.num_loads == 1 and stats.model_cache.num_hits == 1
    assert await client.unpin("a") == 1
    await client.close()


async def test_lru_eviction_never_evicts_pinned(start: Start) -> None:
    paths = {"a": checkpoint(0), "b": checkpoint(1), "c": checkpoint(2)}
    size = weight_layout(ModelSpec.from_dir(paths["a"]), "bfloat16").total_bytes
    cm = start(paths, model_cache=int(2.5 * size))
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    await client.load_model("a", pin=False)
    await client.load_model("b", pin=False)
    await client.load_model("a", pin=False)  # a is now the most recently used
    await client.load_model("c", pin=False)
    stats = await client.stats()
    assert list(resident(stats)) == ["a", "c"]  # b was the least recently used
    assert stats.model_cache.num_evictions == 1
    assert not any(name.endswith("-b") for name in shm_segments(cm.prefix))

    # Pinned models stay even when least recently used.
    await client.load_model("a")
    await client.load_model("c")
    with pytest.raises(RemoteError) as err:
        await client.load_model("b", pin=False)
    assert err.value.code == "model_cache_full"
    detail = err.value.reply.detail or {}
    assert detail["budget_bytes"] == int(2.5 * size) and detail["requested_bytes"] == size
    assert list(resident(await client.stats())) == ["a", "c"]

    await client.unpin("a")  # a is LRU and now unpinned: it goes, c stays
    await client.load_model("b")
    stats = await client.stats()
    assert resident(stats) == {"c": 1, "b": 1}
    assert stats.model_cache.used_bytes == 2 * size <= stats.model_cache.budget_bytes
    await client.close()
    probe = CacheClient(cm.config.cachemgr_address, "probe")
    assert resident(await probe.stats()) == {"c": 0, "b": 0}  # close ended the pins
    await probe.close()


def broken_checkpoints(tmp: Path) -> dict[str, Path]:
    good = checkpoint(0)
    out: dict[str, Path] = {}
    for name in ("missing", "truncated", "garbage", "noconfig"):
        out[name] = tmp / name
        shutil.copytree(good, out[name])
    (out["missing"] / "model.safetensors").unlink()
    data = (good / "model.safetensors").read_bytes()
    (out["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    (out["garbage"] / "model.safetensors").write_bytes(b"\xff" * 64 + data[64:])
    (out["noconfig"] / "config.json").unlink()
    return out


async def test_bad_models_give_clear_errors_and_leave_the_cache_intact(
    start: Start, tmp_path: Path
) -> None:
    broken = broken_checkpoints(tmp_path)
    cm = start({"a": checkpoint(0), **broken})
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    await client.load_model("a")
    before, segments = await client.stats(), shm_segments(cm.prefix)
    with pytest.raises(RemoteError) as err:
        await client.load_model("nope")
    assert err.value.code == "unknown_model" and "'nope'" in str(err.value)
    expect = {
        "missing": "missing file",
        "truncated": "model.safetensors",
        "garbage": "corrupt safetensors header",
        "noconfig": "config.json",
    }
    for name, words in expect.items():
        with pytest.raises(RemoteError) as err:
            await client.load_model(name)
        assert err.value.code == "checkpoint_error", err.value
        assert words in str(err.value) and str(broken[name]) in str(err.value)
    after = await client.stats()
    assert after.model_cache.models == before.model_cache.models
    assert after.model_cache.used_bytes == before.model_cache.used_bytes
    assert after.model_cache.loading == []
    assert shm_segments(cm.prefix) == segments
    await client.close()


async def test_concurrent_loads_share_one_load_while_serving(start: Start) -> None:
    big = checkpoint(3, hidden=512, layers=4, vocab=8192, intermediate=1408)
    cm = start({"big": big}, model_cache="256MiB")
    clients = [CacheClient(cm.config.cachemgr_address, f"w{i}") for i in range(3)]
    for client in clients:
        await client.register()
    loads = [asyncio.create_task(c.load_model("big")) for c in clients[:2]]
    seen_loading = 0
    while not all(t.done() for t in loads):
        stats = await clients[2].stats()  # answered while the load runs
        seen_loading += stats.model_cache.loading == ["big"]
    first, second = [t.result() for t in loads]
    assert seen_loading > 0
    assert first.region.name == second.region.name and not first.hit and not second.hit
    stats = await clients[2].stats()
    assert stats.model_cache.num_loads == 1 and resident(stats) == {"big": 2}
    assert torch.equal(first.data, second.data)
    for client in clients:
        await client.close()


async def test_prewarm_fills_the_budget_without_evicting(start: Start) -> None:
    paths = {"a": checkpoint(0), "b": checkpoint(1)}
    size = weight_layout(ModelSpec.from_dir(paths["a"]), "bfloat16").total_bytes
    cm = start(paths, model_cache=int(1.5 * size), prewarm=["*"])
    client = CacheClient(cm.config.cachemgr_address, "w0")
    for _ in range(200):
        stats = await client.stats()
        if stats.model_cache.models and not stats.model_cache.loading:
            break
        await asyncio.sleep(0.01)
    assert list(resident(stats)) == ["a"] and stats.model_cache.num_evictions == 0
    await client.close()


async def test_models_come_and_go_and_operator_pins_hold_them() -> None:
    """Model lifecycle on the Model Cache itself (in process): a model registered at run
    time loads in the background with its progress known, an operator pin survives LRU
    pressure, a forgotten model leaves once its last worker pin goes."""
    from concurrent.futures import ThreadPoolExecutor

    from aegaeon_cachemgr.errors import CacheError
    from aegaeon_cachemgr.model_cache import OPERATOR, ModelCache
    from aegaeon_cachemgr.model_loader import plan_model

    paths = {name: checkpoint(seed) for seed, name in enumerate("abc")}
    nbytes = plan_model("a", paths["a"], "bfloat16").nbytes
    with ThreadPoolExecutor(2) as pool:
        cache = ModelCache({"a": paths["a"]}, "bfloat16", 2 * nbytes + 100, "aegaeon-t-",
                           pool)  # fmt: skip
        try:
            with pytest.raises(CacheError, match="unknown model 'b'"):
                cache.ensure_loading("b", pin=True)
            cache.register("b", paths["b"])
            cache.ensure_loading("b", pin=True)  # in the background
            assert 0.0 <= cache.progress("b") < 1.0 and "b" in cache.stats().progress
            entry, _ = await cache.acquire("b", "w0", pin=False)
            assert cache.progress("b") == 1.0 and entry.pins == {OPERATOR: 1}
            await cache.acquire("a", "w0", pin=False)
            cache.register("c", paths["c"])
            await cache.acquire("c", "w0", pin=False)  # room: a goes (LRU), b is pinned
            assert [m.name for m in cache.stats().models] == ["b", "c"]
            assert cache.stats().operator_pinned == ["b"]
            cache.set_pinned("b", False)
            await cache.acquire("c", "w0", pin=True)  # a worker reads c
            assert not cache.forget("c")  # pinned by w0: it stays until unpinned
            assert "c" not in cache.stats().known
            with pytest.raises(CacheError, match="unknown model 'c'"):
                await cache.acquire("c", "w1", pin=False)
            cache.unpin("c", "w0")
            assert [m.name for m in cache.stats().models] == ["b"]
            assert cache.forget("b") and cache.stats().models == []
        finally:
            cache.close()


def test_in_memory_entries_are_generated_in_the_region_at_every_load(start: Start,
                                                                    tmp_path: Path) -> None:
    """``market add --random --in-memory``: the cachemgr generates the seeded weights
    straight into the region: the same bytes after an eviction and in another cachemgr,
    other bytes for the other seed, the written twin's bytes, and no file written."""
    from dataclasses import replace

    from aegaeon_market.edit import add_random
    from aegaeon_market.preset_writer import write_preset
    from aegaeon_market.presets import PRESETS

    base = PRESETS["llama-3.2-1b"]
    preset = replace(base, recipe=replace(base.recipe, hidden_size=64, num_layers=2,
                                          num_heads=4, num_kv_heads=2, head_dim=16,
                                          intermediate_size=96))  # fmt: skip
    market = tmp_path / "market"
    paths = {name: add_random(market, preset, name, in_memory=True, progress=False).path
             for name in ("a", "b")}  # fmt: skip
    files_before = sorted(str(p) for p in market.rglob("*"))
    twin = tmp_path / "twin"
    seed_a = json.loads((paths["a"] / "random-weights.json").read_text())["seed"]
    write_preset(preset, twin, "bfloat16", seed=seed_a)
    layout = weight_layout(ModelSpec.from_dir(twin), "bfloat16")
    expected = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fill_layout(twin, layout, expected)
    # the market's records of each entry's files (its config, tokenizer, recipe) checked
    first = start(paths, model_cache=int(1.5 * layout.total_bytes), market=market)

    async def load_all(cm: CacheMgrProcess) -> dict[str, torch.Tensor]:
        client = CacheClient(cm.config.cachemgr_address, "w0")
        await client.register()
        out = {}
        for name in ("a", "b", "a"):  # b evicts a, a comes back: generated again
            model = await client.load_model(name, pin=False)
            assert model.nbytes == layout.total_bytes and not model.hit
            out[name + ("2" if name in out else "")] = model.data.clone()
        stats = await client.stats()
        assert stats.model_cache.num_loads == 3 and stats.model_cache.num_evictions == 2
        await client.close()
        return out

    loaded = asyncio.run(load_all(first))
    assert torch.equal(loaded["a"], expected)  # what its written twin loads
    assert torch.equal(loaded["a2"], loaded["a"])  # the same bytes on every load
    assert (loaded["a"] != loaded["b"]).float().mean() > 0.5  # another seed
    assert first.stop() == 0
    second = start(paths, model_cache=int(1.5 * layout.total_bytes), market=market)
    assert torch.equal(asyncio.run(load_all(second))["a"], expected)  # another cachemgr
    assert second.stop() == 0  # (both share the run dir: neither leaves a segment)
    assert sorted(str(p) for p in market.rglob("*")) == files_before  # nothing written


async def test_an_unreadable_checkpoint_is_quarantined_and_a_reload_brings_it_back(
    start: Start, tmp_path: Path
) -> None:
    """A market whose ``market.json`` records each file (size, sha256): a truncated file
    and a transposed shape are quarantined at start (a stat and the headers), a changed
    byte at the model's first load (the digest, computed while it is read); every other
    model loads; a reload reads a restored file again."""
    import sys

    from aegaeon_common.market_files import record_files
    from aegaeon_common.market_index import Manifest, MarketEntry
    from aegaeon_common.messages.cache import ModelReloaded, ReloadModel

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from market_support import flip_a_byte, swap_a_shape, truncate

    market = tmp_path / "market"
    names = ("good", "truncated", "shape", "flipped")
    for seed, name in enumerate(names):
        shutil.copytree(checkpoint(seed), market / name)
    entries = tuple(MarketEntry(n, market / n, files=record_files(market / n)) for n in names)
    (market / "market.json").write_text(Manifest(0, "", "", entries).to_json(market))
    weights = {n: market / n / "model.safetensors" for n in names}
    kept = weights["flipped"].read_bytes()
    truncate(weights["truncated"], 4096)
    tensor = swap_a_shape(weights["shape"])
    flip_a_byte(weights["flipped"])
    cm = start({n: market / n for n in names}, market=market)
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    unavailable = (await client.stats()).model_cache.unavailable
    assert unavailable == {
        "truncated": f"{weights['truncated']}: 4096 bytes, market.json records "
                     f"{checkpoint(1).joinpath('model.safetensors').stat().st_size}",
        "shape": unavailable["shape"],
    }  # fmt: skip
    assert f"{weights['shape']}: {tensor}: wrong shape" in unavailable["shape"]
    await client.load_model("good")
    with pytest.raises(RemoteError) as err:
        await client.load_model("flipped")  # its first load: the digest differs
    assert err.value.code == "checkpoint_error"
    assert f"{weights['flipped']}: content differs from what market.json records" in str(
        err.value)
    for name in ("truncated", "shape", "flipped"):  # refused, the disk not read again
        with pytest.raises(RemoteError) as err:
            await client.load_model(name)
        assert err.value.code == "checkpoint_error" and str(weights[name]) in str(err.value)
    stats = (await client.stats()).model_cache
    assert sorted(stats.unavailable) == ["flipped", "shape", "truncated"]
    assert [m.name for m in stats.models] == ["good"] and stats.loading == []
    # restored: a reload reads it (and checks its digests) again; the others stay out
    weights["flipped"].write_bytes(kept)
    rpc = client._rpc
    reply = await rpc.call(ReloadModel("flipped", str(market / "flipped")), 30.0)
    assert reply == ModelReloaded("flipped", resident=True)
    assert (await client.load_model("flipped")).hit
    with pytest.raises(RemoteError) as err:
        await rpc.call(ReloadModel("truncated", str(market / "truncated")), 30.0)
    assert err.value.code == "checkpoint_error" and "4096 bytes" in str(err.value)
    assert sorted((await client.stats()).model_cache.unavailable) == ["shape", "truncated"]
    await client.close()


async def test_a_broken_lora_adapter_is_quarantined_alone_and_a_reload_keeps_its_base(
    start: Start, tmp_path: Path
) -> None:
    """LoRA adapters' files are recorded by ``market add`` as a model's are: a truncated
    one is quarantined at start, a changed byte at its first load (its digest); its base
    and the other adapter load as before, and a reload of the restored one serves it as
    an adapter again (its region the adapter's A and B, not a model's)."""
    import sys

    from aegaeon_common.messages.cache import ModelReloaded, ReloadModel
    from aegaeon_engine.lora_spec import AdapterSpec, adapter_layout
    from aegaeon_market.adapters import add_random_adapter

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from lora_support import lora_market
    from market_support import flip_a_byte, truncate

    market = lora_market(tmp_path / "market", {"base": checkpoint(0)})
    paths = {"base": market / "base"}
    for seed, name in enumerate(("good", "cut", "flipped")):
        paths[name] = add_random_adapter(market, name, "base", 4, seed=seed).path
    files = {n: paths[n] / "adapter_model.safetensors" for n in ("cut", "flipped")}
    kept = files["flipped"].read_bytes()
    truncate(files["cut"], 100)
    flip_a_byte(files["flipped"])
    nbytes = adapter_layout(AdapterSpec.from_dir(paths["good"], ModelSpec.from_dir(
        checkpoint(0))), "bfloat16").total_bytes
    cm = start(paths, market=market, bases=dict.fromkeys(("good", "cut", "flipped"), "base"))
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    unavailable = (await client.stats()).model_cache.unavailable
    assert list(unavailable) == ["cut"] and str(files["cut"]) in unavailable["cut"]
    await client.load_model("base")
    assert (await client.load_model("good")).nbytes == nbytes
    with pytest.raises(RemoteError) as err:
        await client.load_model("flipped")
    assert err.value.code == "checkpoint_error"
    assert f"{files['flipped']}: content differs from what market.json records" in str(
        err.value)
    assert sorted((await client.stats()).model_cache.unavailable) == ["cut", "flipped"]
    files["flipped"].write_bytes(kept)
    reply = await client._rpc.call(ReloadModel("flipped", str(paths["flipped"])), 30.0)
    assert reply == ModelReloaded("flipped", resident=True)
    model = await client.load_model("flipped")
    assert model.hit and model.nbytes == nbytes  # an adapter still: its base kept
    assert sorted((await client.stats()).model_cache.unavailable) == ["cut"]
    await client.close()
