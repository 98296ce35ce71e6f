"""The CPU backend's event store: a timeline table in one shared-memory segment.

The table is an array of uint64 counters, one slot per copy stream. An event
is (slot, value) and is complete once `counter[slot] >= value`. The stream
owning a slot assigns increasing values to the events it records (`Timeline`)
and its worker stores each value after the copies before it have finished,
in order, so a counter only ever grows and one 8-byte read answers a query.

Memory ordering: the counter store follows the data stores in program order
(after torch's copy has joined its worker threads); x86-64 keeps stores in
order and aligned 8-byte loads/stores are atomic, so a reader that sees the
value also sees the data. (A weakly ordered CPU would need a release fence
before the store; not a target here.)

Ownership: one process creates the table (later the cachemgr, which hands
slots to workers with `claim_slot`) and unlinks it on `close`; writers attach
it read-write, readers read-only. Value 0 is complete on every slot: the
trivially complete event.
"""

from __future__ import annotations

import threading

from aegaeon_gpumem.closing import Closing
from aegaeon_gpumem.shm import ShmRegion

SLOT_BYTES = 8


class EventTable(Closing):
    """uint64 timeline counters in a shared-memory segment (see module docstring)."""

    def __init__(self, region: ShmRegion) -> None:
        if region.nbytes % SLOT_BYTES:
            raise ValueError(f"event table {region.name!r} is not a whole number of slots")
        self._region = region
        # memoryview cast to native uint64: item access is one 8-byte load/store.
        self._counters = memoryview(region.mapping).cast("Q")
        self._num_slots = region.nbytes // SLOT_BYTES
        self._lock = threading.Lock()
        # Slots this process handed out (owner only); a released slot keeps its
        # counter, so a new stream on it continues above every old event.
        self._claimed: set[int] = set()

    @classmethod
    def create(cls, name: str, num_slots: int) -> EventTable:
        """Create the table `name` with `num_slots` zeroed counters (this process owns it)."""
        if num_slots <= 0:
            raise ValueError(f"an event table needs at least one slot, got {num_slots}")
        return cls(ShmRegion.create(name, num_slots * SLOT_BYTES))

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> EventTable:
        """Map an existing table; read-write to record events on a slot, read-only to wait."""
        return cls(ShmRegion.attach(name, readonly=readonly))

    @property
    def name(self) -> str:
        """The table's shared-memory name (what event handles carry)."""
        return self._region.name

    @property
    def num_slots(self) -> int:
        """Number of counters."""
        return self._num_slots

    @property
    def readonly(self) -> bool:
        """True if this mapping cannot store counters."""
        return self._region.readonly

    @property
    def counters(self) -> memoryview:
        """The counters (uint64 memoryview); `counters[slot]` is one 8-byte read."""
        return self._counters

    def check_slot(self, slot: int) -> int:
        """Return `slot` if it is in range, else raise ValueError."""
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot {slot} outside [0, {self._num_slots}) of {self.name!r}")
        return slot

    def read(self, slot: int) -> int:
        """The counter of `slot`."""
        return int(self._counters[self.check_slot(slot)])

    def store(self, slot: int, value: int) -> None:
        """Set the counter of `slot` to `value` (must not decrease it: events never un-complete)."""
        current = self.read(slot)
        if value < current:
            raise ValueError(f"slot {slot} counter would go back from {current} to {value}")
        self._counters[slot] = value

    def claim_slot(self) -> int:
        """Hand out a slot no other claim in this process holds (the owner's slot registry)."""
        with self._lock:
            for slot in range(self._num_slots):
                if slot not in self._claimed:
                    self._claimed.add(slot)
                    return slot
        raise RuntimeError(f"event table {self.name!r} has no free slot ({self._num_slots})")

    def release_slot(self, slot: int) -> None:
        """Return a claimed slot; its counter is kept (see `claim_slot`)."""
        with self._lock:
            self._claimed.discard(self.check_slot(slot))

    def close(self) -> None:
        """Drop this object's mapping; the owner also unlinks the segment.

        Like `ShmRegion.close`, nothing is unmapped under a live reference:
        events made from this table keep reading their counters until they
        are dropped (the memory goes with the last of them).
        """
        self._region.close()

    def __repr__(self) -> str:
        return f"EventTable({self.name!r}, {self._num_slots} slots)"


class Timeline:
    """The writer side of one slot: assigns event values and signals them in order.

    Only one Timeline may write a slot at a time (the slot's copy stream).
    Values continue from the slot's current counter, so reusing a slot never
    makes an old event incomplete again.
    """

    def __init__(self, table: EventTable, slot: int) -> None:
        if table.readonly:
            raise ValueError(f"timeline on {table.name!r} needs a read-write attachment")
        self._table = table
        self._slot = table.check_slot(slot)
        self._issued = table.read(slot)
        self._lock = threading.Lock()

    @property
    def table(self) -> EventTable:
        """The table holding the slot."""
        return self._table

    @property
    def slot(self) -> int:
        """The slot this timeline writes."""
        return self._slot

    def issue(self) -> int:
        """The next value to wait for (thread-safe; values strictly increase)."""
        with self._lock:
            self._issued += 1
            return self._issued

    def signal(self, value: int) -> None:
        """Mark every event up to `value` complete (called in issue order)."""
        self._table.counters[self._slot] = value
