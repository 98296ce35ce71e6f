"""This node's instances in the store: their hellos and heartbeats as registry records.

On one node the instances report to the proxy over ZeroMQ and reach no store (the
memory store lives in the proxy's process): the proxy writes for them the record
an instance of many nodes writes itself (``aegaeon_runtime.registrar``). So
dispatch reads the same records either way, and an instance that falls silent
leaves it the same way: its record expires.

* a **first hello** this process got is answered with ``ProxyStarted`` before any
  work (what the instance holds is an earlier proxy's, whose clients are gone);
* a **new process** (another pid or incarnation) overwrites the record: the
  replica's next refresh sees the old one leave and ends or re-dispatches what it held;
* a **drain** (``InstanceDraining``) marks the record draining (no new work) and is
  acknowledged (``AckDrain``); the instance counts as restarting until its drain
  timeout plus :data:`RESTART_GRACE_S` has passed without a successor's hello;
* a **stall** (``InstanceStalled``) deletes the record at once (down now, not a TTL
  later); that process says no hello again.

Within one node a report's kind and index name its instance, so what a message
about a request says the instance holds (``Holdings``) is kept too, newer than its
last heartbeat's. The instances' switch and turn records (their heartbeats') are
kept for ``/v1/aegaeon/stats``.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aegaeon_common.config import Config
from aegaeon_common.http_side import with_http_urls
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import AckDrain, ProxyStarted
from aegaeon_common.messages.report import (
    InstanceDraining,
    InstanceHello,
    InstanceStalled,
    InstanceStats,
    SwitchRecord,
    TurnRecord,
)
from aegaeon_common.messages.structs import Holdings
from aegaeon_common.registry import InstanceRecord, load_of, record_of
from aegaeon_common.wire import Message

log = get_logger("cluster")
RESTART_GRACE_S = 60.0  # a drained instance's successor says hello within this
INCARNATION = secrets.randbits(62) + 1  # this proxy process, in the instances' eyes


@dataclass
class _Local:
    """One instance as its reports left it."""

    record: InstanceRecord
    stats: InstanceStats | None = None
    holdings: Holdings | None = None
    restart_by_s: float = 0.0  # (draining) restarting until then
    written_s: float = 0.0  # its record was last written then (monotonic; 0: deleted)


class LocalRegistrar:
    """See the module. ``put(record, live)`` writes a record (``live`` False: deletes
    it); ``send`` sends a message to an instance's record (both the backend's jobs)."""

    def __init__(self, config: Config, put: Callable[[InstanceRecord, bool], None],
                 send: Callable[[InstanceRecord, Message], None]) -> None:  # fmt: skip
        self.config = config
        self.ttl_s = config.store.heartbeat_ttl_s
        # the instances that report here: one node's (with many, each writes its own)
        self.expected: tuple[str, ...] = () if config.distributed else tuple(
            f"{kind}-{i}" for kind, i in config.worker_instances)
        self._put = put
        self._send = send
        self.instances: dict[str, _Local] = {}
        self._stalled: set[tuple[str, int]] = set()  # (name, pid): no record again
        self.switches: deque[tuple[str, SwitchRecord]] = deque(maxlen=config.proxy.stats_records)
        self.turns: deque[tuple[str, TurnRecord]] = deque(maxlen=config.proxy.stats_records)

    def on_hello(self, msg: InstanceHello) -> None:
        name = f"{msg.kind}-{msg.index}"
        if name not in self.expected:
            log.warning("hello from an unknown instance", kind=msg.kind, index=msg.index)
            return
        if (name, msg.pid) in self._stalled:
            return
        known = self.instances.get(name)  # (None: its first hello to this process)
        first = known is None
        if known is not None and (known.record.pid, known.record.incarnation) == \
                (msg.pid, msg.incarnation):  # fmt: skip
            record = msgspec.structs.replace(
                known.record, capacity_tokens=dict(msg.capacity_tokens), latency=msg.latency
            )
        else:
            record = record_of(self.config, msg, name)
            if known is not None:
                log.info("instance_restarted", instance=name, pid=msg.pid)
            self.instances[name] = known = _Local(record)
        known.record = with_http_urls(record, self.config.run_dir)
        if first:
            # (before any work of ours: none goes to an instance before its record, one
            # ordered socket) it drops what it holds and frees the handoffs nobody claimed
            self._send(known.record, ProxyStarted(INCARNATION))
        self._write(known)

    def on_stats(self, msg: InstanceStats) -> None:
        local = self.instances.get(f"{msg.kind}-{msg.index}")
        if local is None or local.written_s == 0.0:
            return  # (its record went: ended or stalled; a hello writes it again)
        local.stats = msg
        self.note_holdings(msg.kind, msg.index, msg.holdings)
        self.switches.extend((local.record.instance_id, s) for s in msg.switches)
        self.turns.extend((local.record.instance_id, t) for t in msg.turns)
        local.record = msgspec.structs.replace(with_http_urls(local.record, self.config.run_dir),
                                              load=load_of(msg))  # fmt: skip
        self._write(local)

    def on_draining(self, msg: InstanceDraining) -> InstanceRecord | None:
        """The ack follows everything sent to it so far."""
        local = self.instances.get(f"{msg.kind}-{msg.index}")
        if local is None or local.record.pid != msg.pid:
            return None
        local.record = msgspec.structs.replace(local.record, draining=True)
        local.restart_by_s = time.monotonic() + msg.timeout_s + RESTART_GRACE_S
        self._write(local)
        self._send(local.record, AckDrain(msg.pid))
        return local.record

    def on_stalled(self, msg: InstanceStalled) -> bool:
        """(Its event loop still beats: ``aegaeon_runtime.liveness``.) True when it was
        this process's."""
        name = f"{msg.kind}-{msg.index}"
        local = self.instances.get(name)
        if local is None or local.record.pid != msg.pid:
            return False
        self._stalled.add((name, msg.pid))
        local.restart_by_s = local.written_s = 0.0
        self._put(local.record, False)
        log.error("instance down", instance=name, why=f"its compute thread stalled: {msg.reason}")
        return True

    def ended(self, name: str) -> bool:
        """Its process ended (not after a drain): True when it had a record (gone now)."""
        local = self.instances.get(name)
        if local is None or local.written_s == 0.0 or local.record.draining:
            return False
        local.written_s = 0.0
        self._put(local.record, False)
        return True

    def leave(self) -> None:
        """This proxy stops: nothing more comes from it."""
        for local in self.instances.values():
            if local.written_s > 0.0:
                self._send(local.record, AckDrain(local.record.pid))

    def _write(self, local: _Local) -> None:
        local.written_s = time.monotonic()
        self._put(local.record, True)

    def note_holdings(self, kind: str, index: int, holdings: Holdings | None) -> None:
        """Keep ``holdings`` if it is the instance's current process's and not older than
        the one kept (see ``aegaeon_runtime.holdings``)."""
        local = self.instances.get(f"{kind}-{index}")
        if local is None or holdings is None or holdings.incarnation != local.record.incarnation:
            return
        kept = local.holdings
        if kept is None or kept.incarnation != holdings.incarnation or \
                holdings.version >= kept.version:  # fmt: skip
            local.holdings = holdings

    def restarting(self, name: str, now_s: float) -> bool:
        local = self.instances.get(name)
        return local is not None and local.record.draining and now_s < local.restart_by_s

    def up(self, name: str, now_s: float) -> bool:
        """Its record was written within its TTL, or it is restarting after a drain."""
        local = self.instances.get(name)
        return local is not None and (now_s - local.written_s < self.ttl_s
                                      or self.restarting(name, now_s))  # fmt: skip

