"""An instance's queues in the shared store, rebuilt from its own after the store lost them.

Many nodes: each instance's prefill queue and decode work list live in the store
(``pq:`` / ``dw:``, :mod:`aegaeon_sched.shared`), written by the replicas'
dispatch transactions, and the instance keeps the same queues as a mirror
(``PrefillQueue``, ``DecodeWorkList``: what it holds, in order). A store that
restarts empty (Redis without persistence) loses the former; the latter are
the truth to rebuild them from:

* the compute thread owns the mirror; the registrar (event loop) asks for a
  :class:`QueueSnapshots` snapshot and the compute thread publishes one between
  two steps, as the queues' stored form (msgpack: a copy);
* :meth:`SharedQueues.rebuild` merges it with what the store holds by then (the
  replicas went on booking work on the empty store: that work is on its way
  here) in one transaction per queue (``merge_prefill_queues``,
  ``merge_work_lists``);
* a request put back this way may have ended here meanwhile (finished, cancelled)
  with its replica's removal already done on the empty store: the instance
  takes each out again once a later snapshot no longer holds it
  (:meth:`SharedQueues.tidy`), so nothing it put back outlives it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aegaeon_common.logs import get_logger
from aegaeon_common.registry import QUEUE_TTL_S, encode, prefill_queue_key, work_list_key
from aegaeon_common.store import Store
from aegaeon_sched.shared import (
    merge_prefill_queues,
    merge_work_lists,
    prefill_queue_of,
    queue_of,
    queued_request_ids,
    remove_requests,
    work_list_of,
)

log = get_logger("registrar")

__all__ = ["QueueSnapshots", "SharedQueues", "Snapshot"]


@dataclass(frozen=True)
class Snapshot:
    """The instance's queues at one moment: its prefill queue and its work list,
    encoded (None: the instance has no such queue)."""

    seq: int
    prefill: bytes | None
    work_list: bytes | None


class QueueSnapshots:
    """Snapshots of a compute thread's queues, on request (thread-safe)."""

    def __init__(self) -> None:
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._latest = Snapshot(0, None, None)

    def request(self) -> int:
        """Ask for a snapshot; returns the seq of the latest one (a newer one answers)."""
        self._wanted.set()
        return self.latest().seq

    def offer(self, take: Callable[[], tuple[bytes | None, bytes | None]]) -> None:
        """On the compute thread, between two steps: publish one if one is wanted."""
        if not self._wanted.is_set():
            return
        self._wanted.clear()  # (before taking it: a request from now on gets the next one)
        prefill, work_list = take()
        with self._lock:
            self._latest = Snapshot(self._latest.seq + 1, prefill, work_list)

    def latest(self) -> Snapshot:
        with self._lock:
            return self._latest


@dataclass
class SharedQueues:
    """Rebuilds one instance's queues in the store (see the module docstring)."""

    store: Store
    instance_id: str
    incarnation: int
    max_group_size: int
    snapshots: QueueSnapshots
    # queue key -> the ids this instance put back there that it still holds
    put_back: dict[str, set[str]] = field(default_factory=dict)
    _asked: int | None = None  # the seq a snapshot must pass (one is on its way)
    _rebuild: bool = False
    num_rebuilds: int = 0

    def lost(self) -> None:
        """The store lost its contents: rebuild at the next snapshot."""
        self._rebuild = True
        self._ask()

    def _ask(self) -> None:
        if self._asked is None:
            self._asked = self.snapshots.request()

    async def step(self) -> None:
        """At each heartbeat: rebuild, or tidy what was put back, once a snapshot newer
        than the last request came. Raises ``StoreError``."""
        if self._asked is None:
            if self.put_back:
                self._ask()
            return
        snapshot = self.snapshots.latest()
        if snapshot.seq <= self._asked:
            return  # (the compute thread is between two steps soon)
        self._asked = None
        if self._rebuild:
            await self._rebuild_from(snapshot)
            self._rebuild = False
        else:
            await self.tidy(snapshot)

    def _keys(self) -> tuple[str, str]:
        return (prefill_queue_key(self.instance_id, self.incarnation),
                work_list_key(self.instance_id, self.incarnation))  # fmt: skip

    async def _rebuild_from(self, snapshot: Snapshot) -> None:
        prefill_key, work_key = self._keys()
        for key, own, prefill in ((prefill_key, snapshot.prefill, True),
                                  (work_key, snapshot.work_list, False)):  # fmt: skip
            if own is None:
                continue
            mine = queued_request_ids(queue_of(own, prefill))

            def merge(values: list[bytes | None], own: bytes = own, prefill: bool = prefill,
                      key: str = key) -> tuple[dict[str, bytes | None], None]:  # fmt: skip
                size = self.max_group_size
                try:
                    merged = (merge_prefill_queues(prefill_queue_of(own, size),
                                                   prefill_queue_of(values[0], size))
                              if prefill else
                              merge_work_lists(work_list_of(own), work_list_of(values[0])))
                except ValueError as exc:  # (a group or batch id of two models: never minted)
                    log.warning("queue_merge_failed", queue=key, error=str(exc))
                    return {key: own}, None
                return {key: encode(merged)}, None

            await self.store.transact([key], merge, ttl_s=QUEUE_TTL_S)
            if mine:
                self.put_back[key] = self.put_back.get(key, set()) | mine
            log.warning("queue_rebuilt", instance=self.instance_id, queue=key,
                        requests=len(mine))  # fmt: skip
        self.num_rebuilds += 1

    async def tidy(self, snapshot: Snapshot) -> None:
        """Take out of the store what this instance put back there and no longer holds."""
        prefill_key, work_key = self._keys()
        held = {prefill_key: queued_request_ids(queue_of(snapshot.prefill, True)),
                work_key: queued_request_ids(queue_of(snapshot.work_list, False))}  # fmt: skip
        for key, ids in list(self.put_back.items()):
            gone = ids - held.get(key, set())
            if not gone:
                continue

            def remove(values: list[bytes | None], gone: set[str] = gone,
                       key: str = key) -> tuple[dict[str, bytes | None], None]:  # fmt: skip
                if values[0] is None:
                    return {}, None  # (the store lost it again: the next rebuild puts back)
                queue = queue_of(values[0], key == prefill_key, self.max_group_size)
                return ({key: encode(queue)} if remove_requests(queue, gone) else {}), None

            await self.store.transact([key], remove, ttl_s=QUEUE_TTL_S)
            left = ids - gone
            if left:
                self.put_back[key] = left
            else:
                del self.put_back[key]

