"""The seam between a worker's event loop (sockets) and its compute thread (torch).

The event loop never runs torch: it puts received commands in an inbox the
compute thread drains, and the compute thread hands outgoing messages back to
the loop, which sends them in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec
import zmq
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.report import StepTokens, TokenItem
from aegaeon_common.transport import secure_socket
from aegaeon_common.wire import Message, encode

T = TypeVar("T")
log = get_logger("bridge")
MAX_ROUTES = 65536  # requests whose proxy an instance remembers


class Inbox(Generic[T]):
    """Thread-safe FIFO from the event loop to the compute thread.

    The compute thread takes from it on every turn of its loop and between any two
    steps or prefills (``poll``), so ``taken_s`` (monotonic; one float store per
    take) is when it last made progress: the liveness check's reading
    (``aegaeon_runtime.liveness``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[T] = queue.SimpleQueue()
        self.taken_s = time.monotonic()

    def put(self, item: T) -> None:
        self._queue.put(item)

    def pending(self) -> int:
        """Items waiting (approximate: another thread may be taking them)."""
        return self._queue.qsize()

    def drain(self) -> list[T]:
        """Everything queued now, without blocking."""
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                self.taken_s = time.monotonic()
                return items

    def wait(self, timeout_s: float) -> list[T]:
        """Block up to ``timeout_s`` for at least one item, then drain."""
        try:
            first = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            self.taken_s = time.monotonic()
            return []
        return [first, *self.drain()]


class Outbox:
    """Messages from the compute thread straight to the proxy's PULL socket.

    Each sending thread gets its own blocking PUSH socket per destination (ZeroMQ
    sockets are not thread-safe), so a decode step's tokens leave without waking
    the event loop; messages of one thread to one destination stay in order.

    Many proxy replicas (``store.kind: redis``): each request's messages go to
    the replica that dispatched it (:meth:`route`, from its work's ``reply_to``);
    a ``StepTokens`` of several requests is split by destination; an answer that
    names its ``reply_to`` (``InstanceModels``, ``ModelsResident``) goes there.
    Messages with no route go to ``address``; with no ``address`` they are
    dropped (counted).
    """

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket[bytes]] = []
        self._lock = threading.Lock()
        self._routes: OrderedDict[str, str] = OrderedDict()
        self.num_dropped = 0
        self.num_unrouted = 0
        self._closed = False  # after close(), what is sent is dropped (no new socket)

    def route(self, request_id: str, address: str) -> None:
        """Messages about ``request_id`` go to ``address`` from now on (the newest
        :data:`MAX_ROUTES` requests are remembered: late tokens of one that ended
        still reach its proxy, which ignores them)."""
        with self._lock:
            self._routes[request_id] = address
            self._routes.move_to_end(request_id)
            if len(self._routes) > MAX_ROUTES:
                self._routes.popitem(last=False)

    def _socket(self, address: str) -> zmq.Socket[bytes] | None:
        """This thread's socket to ``address``; None once closed."""
        socks: dict[str, zmq.Socket[bytes]] | None = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        sock = socks.get(address)
        if sock is None:
            with self._lock:
                if self._closed:
                    return None
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 2000)  # deliver what is queued at close
                sock.setsockopt(zmq.SNDHWM, 100_000)  # queue while the proxy restarts
                secure_socket(sock, address, bind=False)  # CURVE on tcp:// when configured
                sock.connect(address)
                self._sockets.append(sock)
            socks[address] = sock
        return None if sock.closed else sock

    def _destinations(self, msg: Message) -> list[tuple[str | None, Message]]:
        reply_to = getattr(msg, "reply_to", "")
        if isinstance(reply_to, str) and reply_to:  # an answer to the replica that asked
            return [(reply_to, msg)]
        with self._lock:
            if not self._routes:
                return [(self.address, msg)]
            if isinstance(msg, StepTokens):
                parts: dict[str | None, list[TokenItem]] = {}
                for item in msg.items:
                    where = self._routes.get(item.request_id, self.address)
                    parts.setdefault(where, []).append(item)
                if len(parts) == 1:
                    return [(next(iter(parts)), msg)]
                return [(where, msgspec.structs.replace(msg, items=items))
                        for where, items in parts.items()]  # fmt: skip
            request_id = getattr(msg, "request_id", None)
            if isinstance(request_id, str):
                return [(self._routes.get(request_id, self.address), msg)]
            return [(self.address, msg)]

    def send(self, msg: Message) -> None:
        """Callable from any thread; never blocks (a proxy gone for good loses messages,
        as its requests are lost with it)."""
        for address, part in self._destinations(msg):
            if address is None:
                self.num_unrouted += 1
                continue
            sock = self._socket(address)
            if sock is None:  # a late message of a thread that outlived close()
                self.num_dropped += 1
                continue
            try:
                sock.send(encode(part), zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped += 1
                log.warning("proxy unreachable: message dropped", tag=msg.TAG)
            except zmq.ZMQError:  # closed meanwhile (the process is ending)
                self.num_dropped += 1

    def close(self) -> None:
        """Close every socket (each delivers what it queued for up to its linger) and the
        context; a send from a thread still running after this is dropped."""
        with self._lock:
            self._closed = True
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
        self._ctx.term()


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
        self.native_id: int | None = None  # the thread's id in the kernel (/health says it)
        self.ident: int | None = None  # its Python ident (what SyncCacheClient keys calls by)

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self.ident = threading.get_ident()
        try:
            self._body(self.stop)
        except BaseException as exc:  # the thread's last word: report, then the service exits
            log.exception("compute thread crashed")
            self._loop.call_soon_threadsafe(self._on_crash, exc)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        """The body is still running (it returns when its loop drained or was stopped)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        self._thread.join(timeout_s)
