"""Move lists and KVBlockPool: a block with a pending copy is never handed out again."""

from __future__ import annotations

import time

import pytest
from aegaeon_gpumem import (
    CpuEvent,
    Event,
    EventHandle,
    EventTable,
    InvalidFreeError,
    KVBlockPool,
    MoveList,
    OutOfBlocks,
    Timeline,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPE, BLOCK = ("m", 2, 4, 8, 16, "bf16"), 512
SLAB = 8 * BLOCK


pytestmark = pytest.mark.usefixtures("no_leaked_segments")


class LateEvent(Event):
    """A non-CPU event (like a CUDA one) that completes when told to."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def handle(self) -> EventHandle:
        raise NotImplementedError("only used in-process")


def test_move_list_polls_per_slot_in_value_order(table: EventTable) -> None:
    line = Timeline(table, 0)
    moves = MoveList()
    values = [line.issue() for _ in range(3)]
    # Added out of order: value 3, then 1, then 2.
    moves.add(CpuEvent(table, 0, values[2]), [300])
    moves.add(CpuEvent(table, 0, values[0]), [100, 101])
    moves.add(CpuEvent(table, 0, values[1]), [200])
    late = LateEvent()
    moves.add(late, [900])
    assert moves.pending_blocks == 5 and moves.poll() == []
    line.signal(values[1])
    assert sorted(moves.poll()) == [100, 101, 200]
    assert sorted(moves.pending_offsets()) == [300, 900]
    late.done = True
    line.signal(values[2])
    assert sorted(moves.poll()) == [300, 900]
    assert len(moves) == 0


def test_pending_blocks_are_not_reallocated_until_the_event_completes(table: EventTable) -> None:
    line = Timeline(table, 1)
    with KVBlockPool(4 * SLAB, SLAB, reclaimer=False) as pool:
        everything = pool.alloc(SHAPE, BLOCK, 32)
        copy = CpuEvent(table, 1, line.issue())  # a swap-out still reading the blocks
        victims = everything[:8]
        pool.free(victims, copy)
        assert pool.stats().pending_blocks == 8
        with pytest.raises(OutOfBlocks):
            pool.alloc(SHAPE, BLOCK, 1)  # the only free blocks are pending
        pool.free(everything[8:16])  # no event: free at once
        again = pool.alloc(SHAPE, BLOCK, 8)
        assert not set(again) & set(victims)
        with pytest.raises(InvalidFreeError):
            pool.free(victims[:1])  # already pending
        time.sleep(0.01)
        assert pool.reclaim() == 0  # still not complete
        line.signal(copy.value)  # the copy finished, late
        reuse = pool.alloc(SHAPE, BLOCK, 8)  # alloc reclaims before failing
        assert sorted(reuse) == sorted(victims)
        pool.check_integrity()


def test_daemon_reclaims_completed_events(table: EventTable) -> None:
    line = Timeline(table, 2)
    with KVBlockPool(4 * SLAB, SLAB, poll_interval_s=0.001) as pool:
        blocks = pool.alloc(SHAPE, BLOCK, 10)
        event = CpuEvent(table, 2, line.issue())
        pool.free(blocks, event)
        time.sleep(0.02)
        assert pool.stats().pending_blocks == 10
        line.signal(event.value)
        deadline = time.monotonic() + 5.0
        while pool.stats().pending_blocks and time.monotonic() < deadline:
            time.sleep(0.002)
        stats = pool.stats()
        assert stats.pending_blocks == 0 and stats.slabs.used_bytes == 0
        assert stats.slabs.free_slabs == 4  # empty slabs went back to the pool
        pool.free(pool.alloc(SHAPE, BLOCK, 3), Event.completed())  # completed: freed at once
        assert pool.stats().slabs.used_bytes == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "free_late", "complete"]), st.integers(1, 12)),
        max_size=50,
    )
)
def test_random_ops_never_return_pending_blocks(ops: list[tuple[str, int]]) -> None:
    pool = KVBlockPool(6 * SLAB, SLAB, reclaimer=False)
    owned: list[list[int]] = []
    pending: dict[int, LateEvent] = {}  # offset -> its copy's event
    for op, n in ops:
        if op == "alloc":
            try:
                got = pool.alloc(SHAPE, BLOCK, n)
            except OutOfBlocks:
                continue
            assert not any(o in pending and not pending[o].done for o in got)
            for o in got:
                pending.pop(o, None)
            owned.append(got)
        elif op in ("free", "free_late") and owned:
            blocks = owned.pop(n % len(owned))
            if op == "free":
                pool.free(blocks)
            else:
                event = LateEvent()
                pool.free(blocks, event)
                pending.update(dict.fromkeys(blocks, event))
        elif op == "complete" and pending:
            events = list({id(e): e for e in pending.values()}.values())
            events[n % len(events)].done = True
        pool.check_integrity()
    pool.close()
