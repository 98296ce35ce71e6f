"""A ROUTER that serves each request in its own task.

``aegaeon_common.transport.RpcServer`` awaits one handler at a time; the
cachemgr's model loads take seconds (a thread fills the region), and alloc/free
calls from other workers must not queue behind them. Same frames as
``RpcServer``/``RpcClient``: ``[identity, request id (8 bytes), payload]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.transport import new_socket
from aegaeon_common.wire import Channel, Message, WireError, encode

_RID_BYTES = 8
log = get_logger("cachemgr.rpc")

Handler = Callable[[Message], Awaitable[Message]]


class ConcurrentRpcServer:
    """Decode each request with ``channel`` and answer it from its own task.

    A frame that is not a valid request gets an :class:`ErrorReply` (``malformed``,
    ``bad_version``, ``unknown_tag``, ...) and the server keeps serving.
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
            if len(frames) != 3 or len(frames[1]) != _RID_BYTES:
                self.num_bad_frames += 1
                if len(frames) >= 2:
                    reply = ErrorReply("malformed", "want frames [request id (8 bytes), payload]")
                    await self._send(frames[0], b"\0" * _RID_BYTES, reply)
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
            # node's memory manager nor leave its caller waiting for a timeout.
            # The caller gets a typed error; the traceback goes to the log.
            log.exception("handler_failed", tag=request.TAG)
            reply = ErrorReply("internal", f"{request.TAG}: {type(exc).__name__}: {exc}")
        await self._send(identity, rid, reply)

    async def _send(self, identity: bytes, rid: bytes, reply: Message) -> None:
        try:
            await self._sock.send_multipart([identity, rid, encode(reply)])
        except zmq.ZMQError as exc:
            # The peer is gone (ROUTER_MANDATORY is off, so this is rare): the
            # reply has nobody to go to; the request's effect stands.
            log.warning("reply_dropped", tag=reply.TAG, error=str(exc))

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._sock.close(0)
