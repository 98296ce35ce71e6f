"""Registered workers: their leases, their event slots, and whether their process lives.

A lease is ``worker_id`` -> (pid, event slots). Blocks and model pins are
keyed by ``worker_id``; this module only decides who is alive and who holds
which slots. Pure bookkeeping except :func:`process_alive`.

Slot reuse: the event table's counters are monotonic timelines, and a waiter
holding ``(slot, value)`` of a dead worker must not be satisfied by the next
holder's increments. So slots of an ended lease are handed out again last
(free slots first, in the order they were freed).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import psutil

from aegaeon_cachemgr.errors import CacheError


@dataclass(frozen=True)
class Lease:
    """One registration of a worker process."""

    worker_id: str
    pid: int
    create_time: float | None  # the process's start time; None: not watched
    slots: tuple[int, ...]


def pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; 0: unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_identity(pid: int, namespace: int = 0) -> float | None:
    """The start time of ``pid``, or None when it is not a live process visible here
    (0, another PID namespace, or already gone). ``namespace``: the PID namespace the
    number belongs to (0: unknown, taken as this one's)."""
    if pid <= 0 or (namespace and namespace != pid_namespace()):
        return None
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_alive(pid: int, create_time: float) -> bool:
    """True while the process that registered is running (pid reuse and zombies count
    as dead)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == create_time and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class WorkerRegistry:
    """Leases by worker id and the event-slot pool."""

    def __init__(self, num_slots: int, slots_per_worker: int) -> None:
        if num_slots <= 0 or slots_per_worker <= 0:
            raise ValueError("need positive event slot counts")
        self.num_slots = num_slots
        self.slots_per_worker = slots_per_worker
        self._free: deque[int] = deque(range(num_slots))
        self._leases: dict[str, Lease] = {}

    def register(self, worker_id: str, pid: int, num_slots: int = 0,
                 namespace: int = 0) -> tuple[Lease, Lease | None]:  # fmt: skip
        """Start a lease; returns it and the lease it replaces (to be reclaimed by the caller)."""
        if not worker_id:
            raise CacheError("bad_request", "worker_id must not be empty")
        want = num_slots or self.slots_per_worker
        if want < 0:
            raise CacheError("bad_request", f"num_event_slots must be >= 0, got {num_slots}")
        old = self.end(worker_id)
        if want > len(self._free):
            if old is not None:  # keep the old lease's state as it was
                self._take(old.slots)
                self._leases[worker_id] = old
            raise CacheError(
                "bad_request",
                f"no event slots left: {want} wanted, {len(self._free)} free of "
                f"{self.num_slots} (cachemgr.event_slots)",
                {"requested_slots": want, "free_slots": len(self._free)},
            )
        slots = tuple(self._free.popleft() for _ in range(want))
        lease = Lease(worker_id, pid, process_identity(pid, namespace), slots)
        self._leases[worker_id] = lease
        return lease, old

    def _take(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            self._free.remove(slot)

    def end(self, worker_id: str) -> Lease | None:
        """End ``worker_id``'s lease (if any); its slots go to the back of the pool."""
        lease = self._leases.pop(worker_id, None)
        if lease is not None:
            self._free.extend(lease.slots)
        return lease

    def get(self, worker_id: str) -> Lease | None:
        return self._leases.get(worker_id)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._leases

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def dead(self) -> list[Lease]:
        """Watched leases whose process has ended (costs a /proc read per worker)."""
        return [
            lease
            for lease in self._leases.values()
            if lease.create_time is not None and not process_alive(lease.pid, lease.create_time)
        ]
