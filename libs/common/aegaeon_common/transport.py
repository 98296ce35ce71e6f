"""ZeroMQ helpers: typed PUSH/PULL queues and a ROUTER/DEALER request-reply pair.

Frames are :mod:`aegaeon_common.wire` messages. Request-reply adds one frame
before the payload: an 8-byte request id, so one DEALER can have many calls in
flight. A server answers a frame it cannot decode with a typed
:class:`ErrorReply` and keeps running.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from aegaeon_common.logs import get_logger
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.process import private_dir
from aegaeon_common.wire import Channel, Message, WireError, encode

_RID = struct.Struct("<Q")
# No message of ours comes near this (a prompt of a 1 MiB body is ~1.3 MB of msgpack):
# a bigger frame is an attack or a bug, refused before it takes memory.
MAX_FRAME_BYTES = 64 << 20
log = get_logger("transport")


class RemoteError(RuntimeError):
    """The peer answered with an :class:`ErrorReply`."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply
        self.code = reply.code


def prepare_address(address: str) -> None:
    """Make the directory of an ``ipc://`` socket exist, private to this user (0700)."""
    if address.startswith("ipc://"):
        private_dir(Path(address[len("ipc://") :]).parent)


class _Curve:
    """The node's CURVE certificate (``security.curve_key_file``), once per process.

    Every service of a node holds the same certificate: a socket on ``tcp://``
    encrypts with it, and a bound one accepts only peers that prove they hold it
    (a ZAP handler per context allows that one public key). ipc:// sockets are
    guarded by the run directory's permissions instead.
    """

    keys: tuple[bytes, bytes] | None = None  # (public, secret), z85
    _authenticators: dict[int, Any] = {}  # noqa: RUF012 (process-wide, by context)


def configure_security(key_file: Path | None) -> None:
    """Use CURVE on every tcp:// socket of this process from now on (None: off)."""
    if key_file is None:
        _Curve.keys = None
        return
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(key_file))
    if secret is None:
        raise ValueError(f"{key_file} holds no secret key (pass the .key_secret file)")
    _Curve.keys = (public, secret)


def secure_socket(sock: zmq.Socket[Any], address: str, bind: bool) -> None:
    """CURVE on ``sock`` when it speaks tcp:// and a certificate is configured."""
    keys = _Curve.keys
    if keys is None or not address.startswith("tcp://"):
        return
    public, secret = keys
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    if bind:
        _authenticator(sock.context, public)
        sock.curve_server = True
    else:
        sock.curve_serverkey = public


def _authenticator(ctx: zmq.Context[Any], public: bytes) -> None:
    """One ZAP handler per context, allowing only the node's own public key."""
    key = int(ctx.underlying)  # the libzmq context's address (shared by shadows)
    if key in _Curve._authenticators:
        return
    from zmq.auth.thread import ThreadAuthenticator

    class OnlyOurs:
        def callback(self, domain: str, client_key: bytes) -> bool:
            return client_key == public

    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve_callback("*", OnlyOurs())
    _Curve._authenticators[key] = auth


def release_security(ctx: zmq.Context[Any]) -> None:
    """Stop ``ctx``'s ZAP handler, if it has one; before ``ctx.term()`` / ``destroy()``,
    which would wait for its socket forever."""
    auth = _Curve._authenticators.pop(int(ctx.underlying), None)
    if auth is not None:
        auth.stop()


def new_socket(ctx: zmq.asyncio.Context, kind: int, address: str, bind: bool) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # A frame past the limit is never buffered: ZeroMQ drops its sender's connection.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    secure_socket(sock, address, bind)
    if bind:
        prepare_address(address)
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class Pusher:
    """Send typed messages on a PUSH socket (connects by default)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, bind: bool = False) -> None:
        self.address = address
        self._sock = new_socket(ctx, zmq.PUSH, address, bind)

    async def send(self, msg: Message) -> None:
        await self._sock.send(encode(msg))

    async def disconnected(self) -> None:
        """Return when the connected peer goes away (its process ended or closed the
        socket): a ZeroMQ socket monitor's ``EVENT_DISCONNECTED``, at once, where a
        heartbeat would take seconds to miss. Cancel to stop watching."""
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    return
        finally:
            self._sock.disable_monitor()
            monitor.close(0)

    def close(self) -> None:
        self._sock.close(0)


class Puller:
    """Receive typed messages on a PULL socket (binds by default)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, channel: Channel, bind: bool = True
    ) -> None:
        self.address = address
        self.channel = channel
        self._sock = new_socket(ctx, zmq.PULL, address, bind)

    @property
    def bound_address(self) -> str:
        """The endpoint bound last (a ``tcp://host:0`` bind's real port)."""
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    async def recv(self) -> Message:
        """The next message; raises :class:`WireError` for a frame that is not one."""
        return self.channel.decode(await self._sock.recv())

    def close(self) -> None:
        self._sock.close(0)


Handler = Callable[[Message], Awaitable[Message]]


class RpcServer:
    """A ROUTER that answers each request from its own task.

    Requests never queue behind a slow one (the cachemgr's model loads take
    seconds while alloc/free calls must not wait). A frame that is not a valid
    request gets an :class:`ErrorReply` (``malformed``, ``bad_version``,
    ``unknown_tag``, ...); a handler that raises gets the caller an
    ``internal`` error; either way the server keeps serving.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, channel: Channel, handler: Handler
    ) -> None:
        self.address = address
        self.channel = channel
        self._handler = handler
        self._sock = new_socket(ctx, zmq.ROUTER, address, bind=True)
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_requests = 0
        self.num_bad_frames = 0

    async def serve_forever(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != _RID.size:
                self.num_bad_frames += 1
                if len(frames) >= 2:
                    reply = ErrorReply("malformed", "want frames [request id (8 bytes), payload]")
                    await self._send(frames[0], b"\0" * _RID.size, reply)
                continue
            identity, rid, payload = frames
            try:
                request = self.channel.decode(payload)
            except WireError as exc:
                self.num_bad_frames += 1
                await self._send(identity, rid, ErrorReply(exc.code, exc.detail))
                continue
            self.num_requests += 1
            task = asyncio.get_running_loop().create_task(self._serve(identity, rid, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, identity: bytes, rid: bytes, request: Message) -> None:
        try:
            reply = await self._handler(request)
        except Exception as exc:
            # The request boundary: a bug in one handler must neither kill the
            # service nor leave its caller waiting for a timeout. The caller
            # gets a typed error; the traceback goes to the log.
            log.exception("handler_failed", tag=request.TAG)
            reply = ErrorReply("internal", f"{request.TAG}: {type(exc).__name__}: {exc}")
        await self._send(identity, rid, reply)

    async def _send(self, identity: bytes, rid: bytes, reply: Message) -> None:
        try:
            frame = encode(reply)
        except (TypeError, ValueError) as exc:  # a reply that cannot be encoded: a bug here
            log.exception("reply_unencodable", tag=reply.TAG)
            frame = encode(ErrorReply("internal", f"{reply.TAG}: cannot encode the reply ({exc})"))
        try:
            await self._sock.send_multipart([identity, rid, frame])
        except zmq.ZMQError as exc:
            # The peer is gone: the reply has nobody to go to; the effect stands.
            log.warning("reply_dropped", tag=reply.TAG, error=str(exc))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._sock.close(0)


class RpcClient:
    """A DEALER with many calls in flight; replies matched by request id."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, replies: Channel) -> None:
        self.address = address
        self._replies = Channel(replies.name, [*replies._types.values(), ErrorReply])
        self._sock = new_socket(ctx, zmq.DEALER, address, bind=False)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2 or len(frames[0]) != _RID.size:
                continue
            (rid,) = _RID.unpack(frames[0])
            fut = self._pending.pop(rid, None)
            if fut is None or fut.done():
                continue
            try:
                fut.set_result(self._replies.decode(frames[1]))
            except WireError as exc:
                fut.set_exception(exc)

    async def call(self, request: Message, timeout_s: float = 30.0) -> Message:
        """Send ``request``; return its reply. :class:`RemoteError` for an ErrorReply;
        TimeoutError when no reply came within ``timeout_s``, the send included (a DEALER
        with no peer to hand it to waits for one)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        rid = next(self._ids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut

        async def exchange() -> Message:
            await self._sock.send_multipart([_RID.pack(rid), encode(request)])
            return await fut

        try:
            reply = await asyncio.wait_for(exchange(), timeout_s)
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply)
        return reply

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for fut in self._pending.values():
            fut.cancel()
        self._sock.close(0)
