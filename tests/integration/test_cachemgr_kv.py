"""The unified CPU KV cache through a real cachemgr: capacity, move list, leases, handoff."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_common.transport import RemoteError
from aegaeon_runtime.cacheclient.client import CacheClient, SyncCacheClient
from cachemgr_harness import CacheMgrProcess, checkpoint, shm_segments, write_config

SHAPE = KVShapeSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")
BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 2  # K and V, layers, heads, dim, positions, bf16
KV_BYTES = 4 << 20
CAPACITY = KV_BYTES // BLOCK_BYTES
WORKER = str(Path(__file__).with_name("cachemgr_worker.py"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheMgrProcess]:
    """One cachemgr for the module's tests (each leaves it as it found it: see ``cm``)."""
    tmp = tmp_path_factory.mktemp("cachemgr-kv")
    config = write_config(tmp, {"a": checkpoint(0)}, kv_cache=KV_BYTES, slab="1MiB")
    with CacheMgrProcess(config) as proc:
        yield proc
        assert proc.stop() == 0, proc.log()
    assert shm_segments(proc.prefix) == []


@pytest.fixture
def cm(served: CacheMgrProcess) -> Iterator[CacheMgrProcess]:
    """The module's cachemgr, idle: after each test no worker holds a lease, a block or a
    pin (the workers' unregistering, or the reaping of a killed one, awaited). A test
    that leaves it otherwise fails, and the next one gets a fresh cachemgr (this one
    killed: its drain would wait for the lease left; the next removes its segments)."""
    yield served
    left = asyncio.run(held_after(served))
    if left:
        served.stop(signal.SIGKILL)
        served.start()
    assert not left, f"the test left the cachemgr holding {left}"


async def held_after(cm: CacheMgrProcess, timeout_s: float = 30.0) -> dict[str, object]:
    """What the cachemgr still holds once idle, or after ``timeout_s`` (empty: nothing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await probe_stats(cm)
        held: dict[str, object] = {
            "workers": [w.worker_id for w in stats.workers],
            "blocks": stats.kv.used_bytes // BLOCK_BYTES,
            "move_list_blocks": stats.kv.move_list_blocks,
            "pins": {m.name: m.pins for m in stats.model_cache.models if m.pins},
        }
        left = {k: v for k, v in held.items() if v}
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.05)


async def test_alloc_beyond_capacity_is_a_typed_error(cm: CacheMgrProcess) -> None:
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    with pytest.raises(RemoteError) as err:
        await client.alloc_blocks(SHAPE, CAPACITY + 1)
    assert err.value.code == "out_of_blocks"
    detail = err.value.reply.detail or {}
    assert detail["capacity_blocks"] == CAPACITY and detail["requested_blocks"] == CAPACITY + 1
    assert detail["capacity_bytes"] == KV_BYTES and detail["block_bytes"] == BLOCK_BYTES
    assert f"requested {CAPACITY + 1} blocks" in str(err.value) and str(KV_BYTES) in str(
        err.value
    )
    alloc = await client.alloc_blocks(SHAPE, CAPACITY)  # the failure allocated nothing
    assert alloc.block_bytes == BLOCK_BYTES
    assert len(set(alloc.offsets)) == CAPACITY
    assert all(off % BLOCK_BYTES == 0 and off < KV_BYTES for off in alloc.offsets)
    with pytest.raises(RemoteError, match="0 available"):
        await client.alloc_blocks(SHAPE, 1)
    huge = KVShapeSpec(64, 16, 128, 16, "float32")  # one block > a 1 MiB slab
    for shape, code in ((huge, "bad_request"), (KVShapeSpec(0, 2, 16, 16, "x"), "bad_request")):
        with pytest.raises(RemoteError) as err:
            await client.alloc_blocks(shape, 1)
        assert err.value.code == code
    stranger = CacheClient(cm.config.cachemgr_address, "stranger")
    with pytest.raises(RemoteError) as err:
        await stranger.alloc_blocks(SHAPE, 1)
    assert err.value.code == "unknown_owner"
    kv = (await client.stats()).kv
    assert kv.used_bytes == KV_BYTES and kv.blocks_per_owner == {"w0": CAPACITY}
    assert [(s.shape, s.used_blocks) for s in kv.shapes] == [(SHAPE, CAPACITY)]
    await stranger.close()
    await client.close()


async def test_blocks_freed_with_a_pending_event_are_not_reallocated(cm: CacheMgrProcess) -> None:
    client = CacheClient(cm.config.cachemgr_address, "w0")
    reg = await client.register()
    timeline = reg.timeline(0)
    alloc = await client.alloc_blocks(SHAPE, CAPACITY)
    value = timeline.issue()
    freed = await client.free_blocks(
        alloc.offsets, timeline_event(reg.event_table.name, timeline.slot, value)
    )
    assert (freed.num_freed, freed.num_deferred) == (0, CAPACITY)
    assert (await client.stats()).kv.move_list_blocks == CAPACITY
    await asyncio.sleep(0.05)  # the reclaimer polls every millisecond
    with pytest.raises(RemoteError) as err:
        await client.alloc_blocks(SHAPE, 1)
    assert err.value.code == "out_of_blocks"
    timeline.signal(value)
    again = await client.alloc_blocks(SHAPE, CAPACITY)  # reclaimed before failing
    assert sorted(again.offsets) == sorted(alloc.offsets)
    # A completed event frees at once; a foreign event table is refused.
    done = await client.free_blocks(
        again.offsets[:2], timeline_event(reg.event_table.name, timeline.slot, value)
    )
    assert (done.num_freed, done.num_deferred) == (2, 0)
    with pytest.raises(RemoteError) as err:
        await client.free_blocks(again.offsets[2:4], timeline_event("aegaeon-other", 0, 9))
    assert err.value.code == "bad_request"
    with pytest.raises(RemoteError) as err:  # already freed
        await client.free_blocks(again.offsets[:1])
    assert err.value.code == "bad_request"
    await client.close()
    assert (await probe_stats(cm)).kv.used_bytes == 0  # unregister freed the rest


def timeline_event(table: str, slot: int, value: int) -> EventSpec:
    return EventSpec(kind="cpu", table=table, slot=slot, value=value)


async def probe_stats(cm: CacheMgrProcess):  # type: ignore[no-untyped-def]
    probe = CacheClient(cm.config.cachemgr_address, "probe")
    try:
        return await probe.stats()
    finally:
        await probe.close()


async def test_reassign_and_reregister(cm: CacheMgrProcess) -> None:
    w1 = CacheClient(cm.config.cachemgr_address, "w1")
    w2 = CacheClient(cm.config.cachemgr_address, "w2")
    await w1.register()
    old_slots = (await w2.register()).event_slots
    alloc = await w1.alloc_blocks(SHAPE, 3)
    with pytest.raises(RemoteError) as err:
        await w1.reassign_blocks(alloc.offsets, "nobody")
    assert err.value.code == "unknown_owner"
    assert await w1.reassign_blocks(alloc.offsets, "w2") == 3
    assert (await w1.stats()).kv.blocks_per_owner == {"w2": 3}
    with pytest.raises(RemoteError) as err:
        await w1.free_blocks(alloc.offsets)
    assert err.value.code == "not_owner"
    # A restarted w2 registers again: its old lease (blocks, slots) ends.
    reg = await w2.register()
    assert set(reg.event_slots).isdisjoint(old_slots)
    stats = await w1.stats()
    assert stats.kv.blocks_per_owner == {} and stats.kv.used_bytes == 0
    assert {w.worker_id for w in stats.workers} == {"w1", "w2"}
    await w1.close()
    await w2.close()


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def read_json(proc: subprocess.Popen[str]) -> dict:  # type: ignore[type-arg]
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited {proc.wait()}"
    return json.loads(line)  # type: ignore[no-any-return]


def test_two_workers_pass_kv_through_the_unified_cache(cm: CacheMgrProcess) -> None:
    address = cm.config.cachemgr_address
    consumer = spawn("consumer", address, "decode-0")
    assert read_json(consumer) == {"registered": True}
    producer = spawn("producer", address, "prefill-0", "decode-0")
    try:
        handoff = read_json(producer)
        assert consumer.stdin is not None
        consumer.stdin.write(json.dumps(handoff) + "\n")
        consumer.stdin.flush()
        # the producer holds its last piece back: the consumer finds the event pending
        assert read_json(consumer) == {"complete_at_start": False}
        assert producer.stdin is not None
        producer.stdin.write("go\n")
        producer.stdin.flush()
        assert read_json(producer) == {"signaled": True}
        result = read_json(consumer)
    finally:
        assert producer.wait(30) == 0 and consumer.wait(30) == 0
    # its wait ended on the signal, after the last piece: every byte is there
    assert result["waited"] and result["data_ok"] and result["freed"] == len(handoff["offsets"])


def test_killed_worker_lease_is_reclaimed(cm: CacheMgrProcess) -> None:
    holder = spawn("holder", cm.config.cachemgr_address, "decode-1", "a")
    try:
        held = read_json(holder)["held"]
        stats = asyncio.run(probe_stats(cm))
        assert stats.kv.blocks_per_owner == {"decode-1": len(held)}
        assert [(m.name, m.pins) for m in stats.model_cache.models] == [("a", 1)]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        stats = asyncio.run(probe_stats(cm))
        if not stats.workers:
            break
        time.sleep(0.1)
    assert stats.workers == [] and stats.kv.blocks_per_owner == {} and stats.kv.used_bytes == 0
    assert [(m.name, m.pins) for m in stats.model_cache.models] == [("a", 0)]


async def test_sync_facade_serves_a_compute_thread(cm: CacheMgrProcess) -> None:
    client = CacheClient(cm.config.cachemgr_address, "w0")
    reg = await client.register()
    sync = SyncCacheClient(client, asyncio.get_running_loop())

    def compute() -> tuple[int, int]:  # what a worker's compute thread does
        alloc = sync.alloc_blocks(SHAPE, 2)
        reg.block(alloc.offsets[0], alloc.block_bytes).fill_(7)
        model = sync.load_model("a")
        freed = sync.free_blocks(alloc.offsets)
        sync.unpin("a")
        return model.nbytes, freed.num_freed

    nbytes, num_freed = await asyncio.to_thread(compute)
    assert nbytes > 0 and num_freed == 2
    with pytest.raises(RuntimeError, match="deadlock"):
        sync.stats()  # on the loop itself it would block the loop forever
    assert (await client.stats()).kv.used_bytes == 0
    await client.close()

