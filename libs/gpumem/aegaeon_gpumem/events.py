"""Transfer events: record, query, wait, and a handle another process can open.

`Event` is the interface both backends implement. `EventHandle` is its
serialisable form for messages (a plain dict, msgpack-ready):

    {"kind": "cpu", "table": shm name, "slot": int, "value": int}
    {"kind": "cuda", "handle": bytes, "device": int[, "table", "slot", "value"]}

`open_event(handle)` gives an `Event` in any process. CPU events live in a
timeline table (`event_table`); CUDA events are IPC events (`cuda_events`,
which registers its opener here when imported). A CUDA event recorded on a
copy stream that owns a timeline slot also carries its *host mirror*: the
(table, slot, value) its stream signals once the event completed
(`cuda_copies`). `open_host_event` opens that mirror, so a process with no
GPU (the cachemgr: it only needs to know when a copy is done) never touches
CUDA.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

from aegaeon_gpumem.errors import BadEventHandleError
from aegaeon_gpumem.event_table import EventTable

EventKind = Literal["cpu", "cuda"]
_T = TypeVar("_T")

# Polling schedule of `wait`: a few cheap spins (the event is often about to
# complete), then sleeps doubling up to the cap, bounding both the CPU burnt
# on a shared machine and the added latency (<= cap) once it completes.
_SPINS = 64
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 500e-6


@dataclass(frozen=True, slots=True)
class EventHandle:
    """The serialisable form of an event; `to_dict`/`from_dict` for messages."""

    kind: EventKind
    table: str = ""
    slot: int = 0
    value: int = 0
    handle: bytes = b""
    device: int = 0

    @property
    def trivially_complete(self) -> bool:
        """True for the handle of `Event.completed()` (CPU value 0 is always reached)."""
        return self.kind == "cpu" and self.value == 0

    @property
    def host_mirror(self) -> EventHandle | None:
        """The CPU form of this event: itself for a CPU event; a CUDA event's host mirror
        (see the module docstring), or None when it has none."""
        if self.kind == "cpu":
            return self
        if self.table and self.value > 0:
            return EventHandle("cpu", table=self.table, slot=self.slot, value=self.value)
        return None

    def to_dict(self) -> dict[str, str | int | bytes]:
        """The plain-dict form (only the fields of its kind)."""
        if self.kind == "cpu":
            return {"kind": "cpu", "table": self.table, "slot": self.slot, "value": self.value}
        out: dict[str, str | int | bytes] = {"kind": "cuda", "handle": self.handle,
                                             "device": self.device}  # fmt: skip
        if self.table:
            out.update(table=self.table, slot=self.slot, value=self.value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> EventHandle:
        """Parse `to_dict` output; BadEventHandleError names the bad field."""
        kind = data.get("kind")
        if kind == "cpu":
            table = _field(data, "table", str)
            slot = _field(data, "slot", int)
            value = _field(data, "value", int)
            if slot < 0 or value < 0 or (value > 0 and not table):
                raise BadEventHandleError(f"cpu event handle has a bad slot/value/table: {data}")
            return cls("cpu", table=table, slot=slot, value=value)
        if kind == "cuda":
            handle = _field(data, "handle", bytes)
            device = _field(data, "device", int)
            if not handle or device < 0:
                raise BadEventHandleError(
                    f"cuda event handle has an empty handle or bad device: {data}"
                )
            if not data.get("table"):
                return cls("cuda", handle=handle, device=device)
            table = _field(data, "table", str)
            slot = _field(data, "slot", int)
            value = _field(data, "value", int)
            if slot < 0 or value <= 0:
                raise BadEventHandleError(f"cuda event's host mirror has a bad slot/value: {data}")
            return cls("cuda", table=table, slot=slot, value=value, handle=handle, device=device)
        raise BadEventHandleError(f"event handle kind must be 'cpu' or 'cuda', got {kind!r}")


def _field(data: Mapping[str, object], name: str, kind: type[_T]) -> _T:
    value = data.get(name)
    # bool is an int subclass; a flag is never a valid slot, value or device.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadEventHandleError(
            f"event handle field {name!r} must be {kind.__name__}, got {value!r}"
        )
    return value


class Event(ABC):
    """A point in a copy stream's work: complete once every copy before it finished."""

    __slots__ = ()
    _completed: ClassVar[Event]

    @abstractmethod
    def query(self) -> bool:
        """True if the event has completed (never blocks)."""

    @abstractmethod
    def handle(self) -> EventHandle:
        """The serialisable handle another process opens with `open_event`."""

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until complete or `timeout_s` passed; return whether it completed."""
        if self.query():
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for _ in range(_SPINS):
            if self.query():
                return True
        sleep_s = _FIRST_SLEEP_S
        while not self.query():
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                sleep_s = min(sleep_s, remaining)
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)
        return True

    @staticmethod
    def completed() -> Event:
        """An event that is already complete (for copies that finished synchronously)."""
        return Event._completed


class CompletedEvent(Event):
    """The trivially complete event; its handle is the CPU value-0 handle."""

    __slots__ = ()
    _HANDLE: ClassVar[EventHandle] = EventHandle("cpu")

    def query(self) -> bool:
        return True

    def handle(self) -> EventHandle:
        return self._HANDLE

    def __repr__(self) -> str:
        return "Event.completed()"


Event._completed = CompletedEvent()


class CpuEvent(Event):
    """(slot, value) of a timeline table; complete when counter[slot] >= value."""

    __slots__ = ("_counters", "_slot", "_table", "_value")

    def __init__(self, table: EventTable, slot: int, value: int) -> None:
        self._table = table
        self._slot = table.check_slot(slot)
        self._value = value
        self._counters = table.counters

    @property
    def table(self) -> EventTable:
        """The timeline table."""
        return self._table

    @property
    def slot(self) -> int:
        """The timeline slot."""
        return self._slot

    @property
    def value(self) -> int:
        """The counter value that completes the event."""
        return self._value

    def query(self) -> bool:
        # One 8-byte load from shared memory.
        return self._counters[self._slot] >= self._value

    def counter(self) -> int:
        """The slot's current counter (events of the slot up to it are complete)."""
        return int(self._counters[self._slot])

    def handle(self) -> EventHandle:
        return EventHandle("cpu", table=self._table.name, slot=self._slot, value=self._value)

    def __repr__(self) -> str:
        return f"CpuEvent({self._table.name!r}, slot={self._slot}, value={self._value})"


# Read-only attachments of tables opened by handle, by name: one mapping per
# table per process however many events are opened. Names are unique per run
# (they carry the creator's pid and a random tag), so a cached name never
# refers to a different, recreated table.
_tables: dict[str, EventTable] = {}
_tables_lock = threading.Lock()


def attached_table(name: str) -> EventTable:
    """The cached read-only attachment of table `name` (attached on first use)."""
    table = _tables.get(name)
    if table is None:
        with _tables_lock:
            table = _tables.get(name)
            if table is None:
                table = _tables[name] = EventTable.attach(name, readonly=True)
    return table


def _open_cpu(handle: EventHandle) -> Event:
    if handle.trivially_complete:
        return Event.completed()
    try:
        table = attached_table(handle.table)
    except (FileNotFoundError, ValueError) as exc:
        raise BadEventHandleError(f"event table {handle.table!r} cannot be opened: {exc}") from exc
    if not 0 <= handle.slot < table.num_slots:
        raise BadEventHandleError(
            f"slot {handle.slot} outside the {table.num_slots} of {table.name!r}"
        )
    return CpuEvent(table, handle.slot, handle.value)


def _open_cuda_missing(handle: EventHandle) -> Event:
    raise BadEventHandleError("cuda event handle, but aegaeon_gpumem.cuda_events is not loaded")


# Dispatch table kind -> opener; cuda_events replaces the "cuda" entry on import.
OPENERS: dict[str, Callable[[EventHandle], Event]] = {
    "cpu": _open_cpu,
    "cuda": _open_cuda_missing,
}


def open_host_event(handle: EventHandle | Mapping[str, object]) -> Event:
    """Open an event's CPU form (its host mirror for a CUDA event): no CUDA call, for a
    process that only needs to know when a copy is done. BadEventHandleError for a
    CUDA event without a mirror."""
    if not isinstance(handle, EventHandle):
        handle = EventHandle.from_dict(handle)
    mirror = handle.host_mirror
    if mirror is None:
        raise BadEventHandleError("a CUDA event without its host mirror (its copy stream has "
                                  "no timeline slot): this process opens no CUDA event")
    return _open_cpu(mirror)


def open_event(handle: EventHandle | Mapping[str, object]) -> Event:
    """Open an event from its handle (or the handle's dict form) in any process.

    BadEventHandleError if the handle is malformed or names a missing table/slot.
    """
    if not isinstance(handle, EventHandle):
        handle = EventHandle.from_dict(handle)
    return OPENERS[handle.kind](handle)
