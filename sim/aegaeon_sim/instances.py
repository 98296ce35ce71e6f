"""A simulated instance: the service's compute loop on a :class:`~aegaeon_sim.worker.SimWorker`.

The same loop objects ``aegaeon serve`` runs, chosen by the instance's role
(:data:`ROLES`): a prefill instance's :class:`~aegaeon_runtime.prefill.loop.PrefillLoop`;
a decode instance's :class:`~aegaeon_runtime.decode.loop.DecodeLoop`, which is also a
unified instance's (request-level policies send it ``RunRequest``) and, with its
prefill side, a hybrid's (a prefill instance that decodes when idle). Each runs as a
task of the :class:`~aegaeon_sim.events.EventLoop` through the runtime's ports: the
worker (engine, switcher, KV, host cache), the clock, an inbox the simulated proxy
puts commands in and an outbox it reads.

:class:`SimInbox` is the inbox: ``drain`` returns what was put by now, ``wait`` pauses the
loop until a command comes or the timeout passes. An idle loop (nothing queued) waits
for a command alone: its timeout only lets a live loop notice a stop, and nothing
else changes for it meanwhile. ``poll_s``: the loop's own time per pass between
two steps (polling, bookkeeping, streaming; measured on a live node), spent at each
``drain``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aegaeon_common.config import Config
from aegaeon_common.wire import Message
from aegaeon_engine import ModelSpec
from aegaeon_runtime.counters import InstanceCounters
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_runtime.port import MessageSink
from aegaeon_runtime.prefill.loop import PrefillLoop
from aegaeon_runtime.switcher import keeps_resident, prefetches
from aegaeon_sched import LatencyModel, RoundController
from greenlet import getcurrent, greenlet

from aegaeon_sim.events import EventLoop, SimClock
from aegaeon_sim.worker import HostBlocks, SimWorker, SwitchCost, WorkerCosts

ROLES = ("prefill", "decode", "hybrid", "unified")


class SimInbox:
    """An instance's commands (the runtime's ``MessageSource`` port); see the module docstring."""

    def __init__(self, events: EventLoop, poll_s: float = 0.0) -> None:
        self.events = events
        self.poll_s = poll_s
        self.idle: Callable[[], bool] = lambda: False
        self._messages: list[Message] = []
        self._waiting: greenlet | None = None
        self._wakeups = 0

    def put(self, msg: Message) -> None:
        self._messages.append(msg)
        waiting = self._waiting
        if waiting is not None:
            self._waiting = None
            self._wakeups += 1
            token = self._wakeups
            self.events.at(self.events.now, lambda: self._resume(waiting, token))

    def _resume(self, task: greenlet, token: int) -> None:
        if token == self._wakeups and not task.dead:
            self._waiting = None
            task.switch()

    def drain(self) -> list[Message]:
        if self.poll_s > 0:
            self.events.pass_time(self.poll_s)
        out, self._messages = self._messages, []
        return out

    def wait(self, timeout_s: float) -> list[Message]:
        if not self._messages:
            task = getcurrent()
            self._waiting = task
            self._wakeups += 1
            token = self._wakeups
            if not self.idle():  # something in it changes with time (a copy completing)
                self.events.at(self.events.now + timeout_s, lambda: self._resume(task, token))
            self.events.suspend()
            self._waiting = None
        out, self._messages = self._messages, []
        return out


@dataclass(frozen=True)
class NodeSetup:
    """What every simulated instance of a node shares: the deployment's config (the
    loops read their SLO, planner and policy settings there), the models' engine specs
    (their KV shapes), the KV regions' slab size, the operations' costs besides the
    latency model and the loop's own time per pass (``poll_s``)."""

    config: Config
    specs: Mapping[str, ModelSpec]
    slab_bytes: int
    costs: WorkerCosts = field(default_factory=WorkerCosts)
    poll_s: float = 0.0
    units: Mapping[str, str] = field(default_factory=dict)  # LoRA adapters' bases


class SimInstance:
    """One instance (see the module docstring): ``truth`` says what its work takes,
    ``estimator`` is the latency model its loop plans with (its start-up profile,
    refined as it runs), ``switch_s`` prices its switches (default: Eq. 4 of the truth)."""

    def __init__(
        self, name: str, role: str, node: NodeSetup, events: EventLoop, host: HostBlocks,
        outbox: MessageSink, *, truth: LatencyModel, estimator: LatencyModel,
        kv_region_bytes: int, switch_s: SwitchCost | None = None,
        rounds: RoundController | None = None,
    ) -> None:  # fmt: skip
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
        kind, _, index = name.rpartition("-")
        self.name, self.role, self.events = name, role, events
        clock = SimClock(events)
        scheduler = node.config.scheduler
        self.worker = SimWorker(
            node.config, kind, int(index), node.specs, truth, clock,
            kv_region_bytes=kv_region_bytes, slab_bytes=node.slab_bytes, switch_s=switch_s,
            costs=node.costs, host=host, keep_resident=keeps_resident(scheduler),
            prefetch=prefetches(scheduler), record=False, units=node.units,
        )  # fmt: skip
        self.inbox = SimInbox(events, node.poll_s)
        self.loop: DecodeLoop | PrefillLoop
        if role == "prefill":
            prefill = PrefillLoop(self.worker, self.inbox, outbox, clock=clock,
                                  profile=lambda: estimator)  # fmt: skip
            self.inbox.idle = lambda: not prefill.pending()
            self.loop = prefill
        else:
            loop = DecodeLoop(self.worker, self.inbox, outbox, role == "hybrid", clock=clock,
                              rounds=rounds, profile=lambda: estimator)  # fmt: skip
            self.inbox.idle = lambda: not len(loop.work) and not (
                loop.prefill is not None and loop.prefill.pending())
            self.loop = loop
        self._stop = threading.Event()

    @property
    def counters(self) -> InstanceCounters:
        return self.loop.counters

    @property
    def prefill(self) -> PrefillLoop | None:
        """Its prefill side (a prefill or hybrid instance)."""
        if isinstance(self.loop, PrefillLoop):
            return self.loop
        return self.loop.prefill

    def start(self) -> None:
        self.events.spawn(lambda: self.loop.run(self._stop))

    def send(self, msg: Message) -> None:
        self.inbox.put(msg)
