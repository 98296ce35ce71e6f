"""An instance's graceful drain, as its compute loop sees it.

SIGTERM (on the event loop) calls :meth:`Drain.request` and tells the proxy
(``InstanceDraining``); the proxy stops giving the instance work and answers
``AckDrain`` behind everything it sent before. The compute loop keeps
serving and stops once it is idle and acknowledged, or idle with no answer
for ``ack_wait_s`` (no proxy: nothing more can come). With many nodes no replica
answers: the service sets ``acked`` itself once the store lists no replica. The
service bounds the whole drain by ``Config.drain_timeout_s``.
"""

from __future__ import annotations

import os
import threading
import time

from aegaeon_common.messages.prefill import AckDrain
from aegaeon_common.wire import Message

ACK_WAIT_S = 2.0

__all__ = ["ACK_WAIT_S", "Drain"]


class Drain:
    def __init__(self, ack_wait_s: float = ACK_WAIT_S) -> None:
        self.ack_wait_s = ack_wait_s
        self.requested = threading.Event()
        self._since_s = 0.0
        self.acked = False

    def request(self) -> None:
        """Begin draining (any thread)."""
        if not self.requested.is_set():
            self._since_s = time.monotonic()
            self.requested.set()

    def on_ack(self, msg: Message) -> None:
        """The proxy's ``AckDrain`` (compute thread); one for an earlier process is ignored."""
        assert isinstance(msg, AckDrain)
        if msg.pid == os.getpid():
            self.acked = True

    def done(self, idle: bool) -> bool:
        """True when the loop may stop: draining, idle, and nothing more will come."""
        if not idle or not self.requested.is_set():
            return False
        return self.acked or time.monotonic() - self._since_s >= self.ack_wait_s
