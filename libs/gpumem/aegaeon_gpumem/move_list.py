"""Move lists: freed blocks that a copy may still touch, held with that copy's event.

Rule 3 of the paper (§5.3): a new transfer must not target blocks an older
transfer still reads or writes. A block freed while its last copy may be in
flight goes here with the copy's event and is handed back to the allocator
only once the event completed, so allocation never returns such a block.

`MoveList` is the data structure (not thread-safe; the pool locks it).
`KVBlockPool` composes a `SlabAllocator` and a `MoveList` behind one lock,
with a daemon thread that polls the events.

Polling cost: CPU events of one timeline slot complete in value order, so
they sit in a min-heap per slot and a poll reads each slot's counter once and
pops every entry at or below it: O(slots + completed entries), not
O(pending events). Other events (CUDA) are queried one by one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from aegaeon_gpumem.events import CpuEvent, Event

# Heap entries: (value, sequence number to break ties, offsets).
_Entry = tuple[int, int, Sequence[int]]


class MoveList:
    """Pending blocks by event; `poll` returns the offsets whose events completed."""

    def __init__(self) -> None:
        # (table name, slot) -> (an event of that slot to read its counter, heap).
        self._cpu: dict[tuple[str, int], tuple[CpuEvent, list[_Entry]]] = {}
        self._other: list[tuple[Event, Sequence[int]]] = []
        self._seq = itertools.count()
        self._pending_blocks = 0

    @property
    def pending_blocks(self) -> int:
        """Blocks held in the list."""
        return self._pending_blocks

    def __len__(self) -> int:
        return self._pending_blocks

    def add(self, event: Event, offsets: Sequence[int]) -> None:
        """Hold `offsets` until `event` completes."""
        if not offsets:
            return
        offsets = tuple(offsets)
        if isinstance(event, CpuEvent):
            key = (event.table.name, event.slot)
            slot = self._cpu.get(key)
            if slot is None:
                slot = self._cpu[key] = (event, [])
            heapq.heappush(slot[1], (event.value, next(self._seq), offsets))
        else:
            self._other.append((event, offsets))
        self._pending_blocks += len(offsets)

    def poll(self) -> list[int]:
        """Remove and return the offsets whose events have completed."""
        done: list[int] = []
        for key, (probe, heap) in list(self._cpu.items()):
            counter = probe.counter()  # one read covers every event of the slot
            while heap and heap[0][0] <= counter:
                done.extend(heapq.heappop(heap)[2])
            if not heap:
                del self._cpu[key]
        if self._other:
            still: list[tuple[Event, Sequence[int]]] = []
            for event, offsets in self._other:
                if event.query():
                    done.extend(offsets)
                else:
                    still.append((event, offsets))
            self._other = still
        self._pending_blocks -= len(done)
        return done

    def pending_offsets(self) -> list[int]:
        """Every held offset (for integrity checks)."""
        out: list[int] = []
        for _, heap in self._cpu.values():
            for entry in heap:
                out.extend(entry[2])
        for _, offsets in self._other:
            out.extend(offsets)
        return out
