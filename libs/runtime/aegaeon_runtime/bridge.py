"""The seam between a worker's event loop (sockets) and its compute thread (torch).

The event loop never runs torch: it puts received commands in an inbox the
compute thread drains, and the compute thread hands outgoing messages back to
the loop, which sends them in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from aegaeon_common.logs import get_logger
from aegaeon_common.transport import Pusher
from aegaeon_common.wire import Message

T = TypeVar("T")
log = get_logger("bridge")


class Inbox(Generic[T]):
    """Thread-safe FIFO from the event loop to the compute thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[T] = queue.SimpleQueue()

    def put(self, item: T) -> None:
        self._queue.put(item)

    def drain(self) -> list[T]:
        """Everything queued now, without blocking."""
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def wait(self, timeout_s: float) -> list[T]:
        """Block up to ``timeout_s`` for at least one item, then drain."""
        try:
            first = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *self.drain()]


class Outbox:
    """Messages from the compute thread, sent by the event loop in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pusher: Pusher) -> None:
        self._loop = loop
        self._pusher = pusher
        self._queue: asyncio.Queue[Message] = asyncio.Queue()

    def send(self, msg: Message) -> None:
        """Callable from any thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, msg)

    async def pump(self) -> None:
        """Run on the event loop: forward queued messages to the socket."""
        while True:
            msg = await self._queue.get()
            await self._pusher.send(msg)

    async def flush(self) -> None:
        while not self._queue.empty():
            await self._pusher.send(self._queue.get_nowait())


class ComputeThread:
    """Runs ``body(stop)`` on a daemon thread; ``stop`` is a threading.Event.

    If ``body`` raises, the error is logged and ``on_crash`` runs on the event
    loop (services exit non-zero, so the supervisor restarts them).
    """

    def __init__(
        self,
        name: str,
        body: Callable[[threading.Event], None],
        loop: asyncio.AbstractEventLoop,
        on_crash: Callable[[BaseException], None],
    ) -> None:
        self.stop = threading.Event()
        self._body = body
        self._loop = loop
        self._on_crash = on_crash
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self._body(self.stop)
        except BaseException as exc:  # the thread's last word: report, then the service exits
            log.exception("compute thread crashed")
            self._loop.call_soon_threadsafe(self._on_crash, exc)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        self._thread.join(timeout_s)
