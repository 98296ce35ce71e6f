"""Events in one process: timeline table, CPU events, handles and their dict form."""

from __future__ import annotations

import threading

import msgpack
import pytest
from aegaeon_gpumem import (
    BadEventHandleError,
    CpuEvent,
    Event,
    EventHandle,
    EventTable,
    Timeline,
    open_event,
    unique_name,
)
from aegaeon_gpumem.events import attached_table
from gpumem_support import TAG

pytestmark = pytest.mark.usefixtures("no_leaked_segments")


def test_timeline_events_complete_in_order(table: EventTable) -> None:
    line = Timeline(table, 2)
    e1 = CpuEvent(table, 2, line.issue())
    e2 = CpuEvent(table, 2, line.issue())
    assert (e1.value, e2.value) == (1, 2)
    assert not e1.query() and not e2.query()
    line.signal(1)
    assert e1.query() and not e2.query()
    assert e1.wait(0) and not e2.wait(0.01)
    line.signal(2)
    assert e2.wait(0.01)
    assert table.read(2) == 2 and table.read(0) == 0
    # A new timeline on a used slot continues above it: old events stay complete.
    again = Timeline(table, 2)
    assert again.issue() == 3 and e2.query()
    with pytest.raises(ValueError):
        table.store(2, 1)  # counters never go back
    with pytest.raises(ValueError):
        Timeline(table, 4)


def test_wait_wakes_when_signalled_from_another_thread(table: EventTable) -> None:
    line = Timeline(table, 0)
    event = CpuEvent(table, 0, line.issue())
    signalled = threading.Event()

    def signal() -> None:
        signalled.set()
        line.signal(1)

    timer = threading.Timer(0.05, signal)  # most likely while the wait below blocks
    assert not event.query()
    timer.start()
    assert event.wait(60.0)  # woken by the signal (a busy machine may take its time)
    assert signalled.is_set() and event.query()  # not before it
    timer.join()


def test_handle_roundtrip_through_msgpack(table: EventTable) -> None:
    line = Timeline(table, 1)
    event = CpuEvent(table, 1, line.issue())
    wire = msgpack.packb(event.handle().to_dict())
    data = msgpack.unpackb(wire)
    assert data == {"kind": "cpu", "table": table.name, "slot": 1, "value": 1}
    opened = open_event(data)
    assert isinstance(opened, CpuEvent) and not opened.query()
    line.signal(1)
    assert opened.query()
    # Opened events share one cached read-only attachment per table.
    assert attached_table(table.name) is opened.table and opened.table.readonly
    again = open_event(EventHandle.from_dict(data))
    assert isinstance(again, CpuEvent) and again.table is opened.table
    cuda = EventHandle("cuda", handle=b"\x01" * 64, device=1)
    assert EventHandle.from_dict(msgpack.unpackb(msgpack.packb(cuda.to_dict()))) == cuda


def test_completed_event() -> None:
    done = Event.completed()
    assert done.query() and done.wait(0)
    handle = done.handle()
    assert handle.trivially_complete
    assert handle.to_dict() == {"kind": "cpu", "table": "", "slot": 0, "value": 0}
    assert open_event(handle.to_dict()).query()


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "rocm"},
        {"kind": "cpu", "table": "aegaeon-x", "slot": "1", "value": 1},
        {"kind": "cpu", "table": "aegaeon-x", "slot": -1, "value": 1},
        {"kind": "cpu", "table": "", "slot": 0, "value": 5},
        {"kind": "cpu", "table": "aegaeon-x", "slot": True, "value": 1},
        {"kind": "cuda", "handle": b"", "device": 0},
        {"kind": "cuda", "handle": "text", "device": 0},
    ],
)
def test_bad_handles_are_typed_errors(bad: dict[str, object]) -> None:
    with pytest.raises(BadEventHandleError):
        EventHandle.from_dict(bad)


def test_opening_a_missing_table_or_slot_is_a_bad_handle(table: EventTable) -> None:
    with pytest.raises(BadEventHandleError, match="cannot be opened"):
        open_event({"kind": "cpu", "table": unique_name(TAG), "slot": 0, "value": 1})
    with pytest.raises(BadEventHandleError, match="outside"):
        open_event({"kind": "cpu", "table": table.name, "slot": 4, "value": 1})


def test_claim_slots(table: EventTable) -> None:
    slots = [table.claim_slot() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="no free slot"):
        table.claim_slot()
    table.release_slot(2)
    assert table.claim_slot() == 2
