"""What runs on an instance's compute thread: the state and commands its loops share.

Two loops: :class:`~aegaeon_runtime.prefill.loop.PrefillLoop` (a prefill instance)
and :class:`~aegaeon_runtime.decode.loop.DecodeLoop` (a decode or hybrid instance).
``run`` first profiles the worker (the latency model of its start-up profile goes
in ``latency``) and then sets ``ready``; the instance announces itself only then.
``run`` returns when stopped, or once ``drain`` says it drained.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from aegaeon_common.messages.prefill import AddModel, ProxyStarted
from aegaeon_common.messages.report import InstanceStats
from aegaeon_common.messages.structs import Holdings
from aegaeon_common.wire import Message
from aegaeon_sched import LatencyModel

from aegaeon_runtime.clock import Clock
from aegaeon_runtime.drain import Drain
from aegaeon_runtime.holdings import HoldingsBook
from aegaeon_runtime.metrics import InstanceLoad
from aegaeon_runtime.models import add_model
from aegaeon_runtime.port import MessageSink, MessageSource, WorkerPort
from aegaeon_runtime.shared_queues import QueueSnapshots


class InstanceLoop(ABC):
    """A loop's worker, inbox and outbox, and what the service reads of it."""

    holdings: HoldingsBook  # what it holds for its requests (aegaeon_runtime.holdings)
    _handlers: dict[type[Message], Callable[[Message], None]]  # by command type

    def __init__(self, worker: WorkerPort, inbox: MessageSource, outbox: MessageSink,
                 clock: Clock) -> None:
        self.worker = worker
        self.inbox = inbox
        self.outbox = outbox
        self.clock = clock
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.latency: LatencyModel | None = None
        self.load = InstanceLoad()  # queue depths for /metrics: written here, read by a scrape
        self.snapshots = QueueSnapshots()  # its queues, for the registrar (many nodes)
        self.drain = Drain()
        self._proxy = 0  # the proxy process that last said it started

    @abstractmethod
    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (drain ``inbox``, compute, send via ``outbox``)."""

    @abstractmethod
    def stats(self) -> InstanceStats:
        """A snapshot for the heartbeat (called on the event loop's thread)."""

    @abstractmethod
    def _publish_load(self) -> None:
        """``load`` replaced with the queues' depths now."""

    def apply(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self._handlers[type(msg)](msg)

    def _changed(self) -> Holdings:
        """After a request's end (its KV freed): the load published, then the reading
        its message carries (see ``aegaeon_runtime.holdings``)."""
        self._publish_load()
        return self.holdings.after_change()

    def _new_proxy(self, msg: Message) -> bool:
        """Whether ``ProxyStarted`` comes from a new proxy (it sends this before any
        work): what the instance holds from before is then an old proxy's."""
        assert isinstance(msg, ProxyStarted)
        if msg.proxy == self._proxy:
            return False
        self._proxy = msg.proxy
        self.drain.acked = False  # a drain waits for this proxy's answer
        return True

    def _on_shutdown(self, msg: Message) -> None:
        self._stop.set()

    def _on_add_model(self, msg: Message) -> None:
        assert isinstance(msg, AddModel)
        self.outbox.send(add_model(self.worker, self.latency, msg))
