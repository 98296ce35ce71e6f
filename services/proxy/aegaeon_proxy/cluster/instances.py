"""The proxy's view of the instances: addresses, liveness, counters, switches.

Liveness comes from the instances' heartbeats (hello + stats every 0.5 s): an
instance silent for ``DEAD_AFTER_S`` is down, and one that says hello with a
new pid was restarted; in both cases the requests it held are lost and fail.
An instance that announced a drain (``InstanceDraining``) finishes what it
holds and exits; it counts as alive (restarting) until its drain timeout
plus ``RESTART_GRACE_S`` has passed without a hello from its successor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq.asyncio
from aegaeon_common.config import Config
from aegaeon_common.messages.report import (
    InstanceHello,
    InstanceStats,
    SwitchRecord,
    TurnRecord,
)
from aegaeon_common.messages.structs import Holdings
from aegaeon_common.transport import Pusher
from aegaeon_common.wire import Message
from aegaeon_sched import DecodeShare

DEAD_AFTER_S = 5.0
RESTART_GRACE_S = 60.0  # a drained instance's successor says hello within this


@dataclass
class InstanceView:
    name: str  # "prefill-0", "decode-1": the policy's InstanceId
    kind: str  # the process kind: "prefill" | "decode"
    index: int
    pusher: Pusher
    pid: int | None = None
    last_seen_s: float = 0.0
    hello: InstanceHello | None = None
    stats: InstanceStats | None = None
    draining: bool = False  # announced a drain; back when a new pid says hello
    restart_by_s: float = 0.0  # (draining) down if no successor by then
    paused: bool = False  # the policy gives it no new work (draining or down)
    # the models on its device and the instance's count of changes to them (-1: none
    # heard from this process yet); an older report than the last one is stale
    resident: tuple[str, ...] = ()
    residency_version: int = -1
    # what it holds for its requests, from its heartbeat or the last message that ended
    # or handed on a request, whichever read it later (None: none heard from this process)
    holdings: Holdings | None = None

    def note_residency(self, models: list[str], version: int) -> None:
        if version >= self.residency_version:
            self.resident, self.residency_version = tuple(models), version

    def note_holdings(self, holdings: Holdings | None) -> None:
        """Keep ``holdings`` if it is this process's (its hello's incarnation) and not
        older than the one kept (see ``aegaeon_runtime.holdings``)."""
        if holdings is None or holdings.incarnation != self.incarnation:
            return
        kept = self.holdings
        if kept is None or kept.incarnation != holdings.incarnation or \
                holdings.version >= kept.version:  # fmt: skip
            self.holdings = holdings

    @property
    def incarnation(self) -> int:
        """The process that said hello last (0: none yet): work is stamped with it."""
        return self.hello.incarnation if self.hello is not None else 0

    def alive(self, now_s: float) -> bool:
        if self.draining and now_s < self.restart_by_s:
            return True
        return self.pid is not None and now_s - self.last_seen_s < DEAD_AFTER_S

    async def send(self, msg: Message) -> None:
        await self.pusher.send(msg)


@dataclass
class Instances:
    """Every configured instance, alive or not."""

    views: dict[str, InstanceView]
    max_records: int = 2000  # proxy.stats_records
    switches: deque[tuple[str, SwitchRecord]] = field(default_factory=deque)
    turns: deque[tuple[str, TurnRecord]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.switches = deque(self.switches, maxlen=self.max_records)
        self.turns = deque(self.turns, maxlen=self.max_records)

    @classmethod
    def connect(cls, config: Config, ctx: zmq.asyncio.Context) -> Instances:
        """Pushers to every instance the node runs (see ``aegaeon_cli.node``): the
        request-level baselines run every worker as a unified instance, decode
        processes ``decode-0..P+D-1``."""
        total = config.prefill.instances + config.decode.instances
        views: dict[str, InstanceView] = {}
        for index in range(total):
            name = f"decode-{index}"
            views[name] = InstanceView(name, "decode", index,
                                       Pusher(ctx, config.decode_address(index)))  # fmt: skip
        return cls(views, max_records=config.proxy.stats_records)

    def __iter__(self) -> Iterator[InstanceView]:
        return iter(self.views.values())

    def get(self, kind: str, index: int) -> InstanceView | None:
        return self.views.get(f"{kind}-{index}")

    def on_hello(self, msg: InstanceHello) -> tuple[InstanceView | None, bool]:
        """Record a hello; returns (view, restarted: another process had said hello)."""
        view = self.get(msg.kind, msg.index)
        if view is None:
            return None, False
        before = view.hello
        restarted = view.pid is not None and (
            view.pid != msg.pid or (before is not None and before.incarnation != msg.incarnation)
        )
        if restarted:
            view.draining = False
            view.resident, view.residency_version = (), -1  # a new process's count
            view.holdings = None  # and its versions
        view.pid, view.hello, view.last_seen_s = msg.pid, msg, time.monotonic()
        return view, restarted

    def on_draining(self, kind: str, index: int, pid: int, timeout_s: float) -> InstanceView | None:
        """Record a drain announcement (from the instance's current process)."""
        view = self.get(kind, index)
        if view is None or view.pid != pid:
            return None
        view.draining, view.paused = True, True
        view.restart_by_s = time.monotonic() + timeout_s + RESTART_GRACE_S
        return view

    def on_stats(self, msg: InstanceStats) -> InstanceView | None:
        view = self.get(msg.kind, msg.index)
        if view is None or view.pid is None:
            return None
        view.stats, view.last_seen_s = msg, time.monotonic()
        view.note_residency(msg.resident_models, msg.residency_version)
        view.note_holdings(msg.holdings)
        for record in msg.switches:
            self.switches.append((view.name, record))
        for turn in msg.turns:
            self.turns.append((view.name, turn))
        return view

    def note_holdings(self, kind: str, index: int, holdings: Holdings | None) -> None:
        """What a message about a request says its instance holds, noted before the
        request is answered (a newer reading than the last heartbeat's, or none)."""
        view = self.get(kind, index)
        if view is not None and view.pid is not None:
            view.note_holdings(holdings)

    def all_alive(self) -> bool:
        now = time.monotonic()
        return all(v.alive(now) for v in self)

    def newly_dead(self) -> list[InstanceView]:
        """Instances whose heartbeat stopped; they are forgotten until a new hello."""
        now = time.monotonic()
        dead = [v for v in self if v.pid is not None and not v.alive(now)]
        for view in dead:
            self.mark_dead(view)
        return dead

    @staticmethod
    def mark_dead(view: InstanceView) -> None:
        """Forget its process until a new hello; it gets no work meanwhile."""
        view.pid, view.draining, view.paused = None, False, True

    def close(self) -> None:
        for view in self:
            view.pusher.close()


class DecodeShares:
    """Each hybrid instance's share of time left for decoding, from its heartbeats
    (:class:`~aegaeon_sched.DecodeShare`'s rule, one per instance, on this clock)."""

    def __init__(self) -> None:
        self._shares: dict[str, DecodeShare] = {}

    def observe(self, instance: str, prefill_s: float) -> float:
        share = self._shares.setdefault(instance, DecodeShare(min_interval_s=0.0))
        return share.observe(time.monotonic(), prefill_s)
