"""The cachemgr's CPU-only event path: a CUDA event's host mirror, opened with no CUDA.

A worker's CUDA copy stream that owns a timeline slot records each event with its
host mirror (table, slot, value) and signals the slot once the event completed; the
cachemgr frees host KV blocks behind that mirror (the move list) and never opens
the CUDA handle, so it runs with ``CUDA_VISIBLE_DEVICES=""``. Here the mirror is
signalled by hand (no GPU); ``scripts/gpu-check``'s ``namespaces`` step does it with
CUDA copies in flight.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest
from aegaeon_cachemgr.errors import CacheError
from aegaeon_cachemgr.kv_cache import UnifiedKVCache
from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_gpumem import EventHandle, EventTable, ShmRegion, Timeline, open_host_event
from aegaeon_gpumem.errors import BadEventHandleError
from aegaeon_runtime.cacheclient.convert import to_event

SHAPE = KVShapeSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")
CUDA_HANDLE = b"\x07" * 64


@pytest.fixture
def cache() -> Iterator[tuple[UnifiedKVCache, EventTable]]:
    tag = f"aegaeon-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    region = ShmRegion.create(f"{tag}-kv", 1 << 20)
    table = EventTable.create(f"{tag}-events", 8)
    kv = UnifiedKVCache(region, 64 << 10, table.name)
    try:
        yield kv, table
    finally:
        kv.close()
        table.close()
        region.close()


def _cuda(table: EventTable, slot: int, value: int) -> EventHandle:
    return EventHandle("cuda", table=table.name, slot=slot, value=value, handle=CUDA_HANDLE,
                       device=3)  # fmt: skip


def test_a_cuda_handle_carries_its_host_mirror_on_the_wire(
        cache: tuple[UnifiedKVCache, EventTable]) -> None:  # fmt: skip
    _, table = cache
    handle = _cuda(table, 2, 5)
    wire = msgpack.unpackb(msgpack.packb(handle.to_dict()))
    assert wire == {"kind": "cuda", "handle": CUDA_HANDLE, "device": 3, "table": table.name,
                    "slot": 2, "value": 5}  # fmt: skip
    assert EventHandle.from_dict(wire) == handle
    assert handle.host_mirror == EventHandle("cpu", table=table.name, slot=2, value=5)
    bare = EventHandle("cuda", handle=CUDA_HANDLE, device=0)
    assert bare.host_mirror is None and "table" not in bare.to_dict()
    with pytest.raises(BadEventHandleError, match="without its host mirror"):
        open_host_event(bare)


def test_blocks_wait_for_the_mirror_of_a_copy_in_flight(
        cache: tuple[UnifiedKVCache, EventTable]) -> None:  # fmt: skip
    kv, table = cache
    writer = Timeline(EventTable.attach(table.name), 1)
    offsets, _ = kv.alloc("decode-0", SHAPE, 3)
    value = writer.issue()
    spec = to_event(_cuda(table, 1, value))
    assert kv.free("decode-0", offsets, spec) == (0, 3)  # the copy has not finished
    stats = kv.stats()
    assert stats.move_list_blocks == 3 and stats.deferred_blocks == 3
    assert stats.blocks_per_owner == {}
    writer.signal(value)  # the worker's mirror thread, once the CUDA event completed
    deadline = time.monotonic() + 10
    while kv.stats().move_list_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv.stats().move_list_blocks == 0
    again, _ = kv.alloc("decode-0", SHAPE, 3)  # the reclaimed blocks are handed out again
    assert sorted(again) == sorted(offsets)
    assert kv.free("decode-0", again, to_event(_cuda(table, 1, value))) == (3, 0)
    assert kv.stats().freed_blocks == 3


def test_a_cuda_event_without_a_mirror_or_of_another_table_is_refused(
        cache: tuple[UnifiedKVCache, EventTable]) -> None:  # fmt: skip
    kv, _table = cache
    offsets, _ = kv.alloc("prefill-0", SHAPE, 2)
    bare = EventSpec("cuda", "", 0, 0, CUDA_HANDLE, 0)
    with pytest.raises(CacheError, match="without its host mirror") as err:
        kv.free("prefill-0", offsets, bare)
    assert err.value.code == "bad_request"
    foreign = to_event(EventHandle("cuda", table="aegaeon-other-events", slot=1, value=1,
                                   handle=CUDA_HANDLE, device=0))  # fmt: skip
    with pytest.raises(CacheError, match="is not this cachemgr's"):
        kv.free("prefill-0", offsets, foreign)
    assert kv.stats().blocks_per_owner == {"prefill-0": 2}  # a refused free keeps the lease
    assert kv.free("prefill-0", offsets, None) == (2, 0)


def test_a_worker_of_another_pid_namespace_is_not_watched_by_its_number() -> None:
    """A worker in a container of its own registers its pid there (often 1): that number
    is another process here, so the cachemgr does not watch it (a lease then ends when
    the worker unregisters or registers again)."""
    from aegaeon_cachemgr.workers import WorkerRegistry, pid_namespace

    registry = WorkerRegistry(8, 2)
    here, _ = registry.register("prefill-0", os.getpid(), 0, pid_namespace())
    assert here.create_time is not None  # same namespace: watched
    there, _ = registry.register("decode-0", os.getpid(), 0, pid_namespace() + 1)
    assert there.create_time is None and registry.dead() == []
