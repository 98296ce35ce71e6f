"""tcp:// with the node's CURVE certificate: its holders talk, nobody else gets through
(no key, or another key that knows the server's public one); the context still ends."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from aegaeon_common.messages.cache import REPLIES, REQUESTS, GetStats
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.transport import (
    RemoteError,
    RpcClient,
    RpcServer,
    configure_security,
    release_security,
)
from aegaeon_common.wire import Message, encode


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def certificate(tmp_path: Path) -> Path:
    out = subprocess.run([sys.executable, "-m", "aegaeon_cli.main", "keys", "curve",
                          str(tmp_path / "node.key")], capture_output=True, text=True,
                         check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    secret = tmp_path / "node.key_secret"
    assert secret.stat().st_mode & 0o077 == 0
    return secret


async def test_only_holders_of_the_certificate_get_through(certificate: Path) -> None:
    address = f"tcp://127.0.0.1:{_port()}"
    public, _ = zmq.auth.load_certificate(str(certificate))
    configure_security(certificate)
    try:
        ctx = zmq.asyncio.Context()

        async def handler(msg: Message) -> Message:
            return ErrorReply("ok", msg.TAG)

        server = RpcServer(ctx, address, REQUESTS, handler)
        serving = asyncio.create_task(server.serve_forever())
        client = RpcClient(ctx, address, REPLIES)  # holds the certificate
        with pytest.raises(RemoteError, match="ok"):  # the handler's typed answer
            await client.call(GetStats(), timeout_s=10.0)
        for keys in (None, zmq.curve_keypair()):  # no CURVE; a stranger's key pair
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                sock.curve_publickey, sock.curve_secretkey = keys
                sock.curve_serverkey = public  # even knowing the server's public key
            sock.connect(address)

            async def ask(sock: zmq.asyncio.Socket = sock) -> list[bytes]:
                await sock.send_multipart([struct.pack("<Q", 1), encode(GetStats())])
                return await sock.recv_multipart()

            with pytest.raises(TimeoutError):  # no answer (the send may wait for a peer)
                await asyncio.wait_for(ask(), 1.5)
            sock.close(0)
        assert server.num_requests == 1
        serving.cancel()
        client.close()
        server.close()
        release_security(ctx)
        await asyncio.wait_for(asyncio.to_thread(ctx.term), 10.0)  # does not hang
    finally:
        configure_security(None)


def test_a_certificate_without_its_secret_is_refused(certificate: Path) -> None:
    with pytest.raises(ValueError, match="no secret key"):
        configure_security(certificate.with_name("node.key"))


async def test_a_call_with_no_peer_to_take_it_ends_at_its_timeout() -> None:
    """The timeout bounds the send too: a DEALER that may only queue to a connected peer
    (ZMQ_IMMEDIATE) waits in its send while nobody listens."""
    address = f"tcp://127.0.0.1:{_port()}"  # nobody binds it
    ctx = zmq.asyncio.Context()
    client = RpcClient(ctx, address, REPLIES)
    client._sock.disconnect(address)
    client._sock.setsockopt(zmq.IMMEDIATE, 1)
    client._sock.connect(address)
    try:
        with pytest.raises(TimeoutError):
            await client.call(GetStats(), timeout_s=0.5)
    finally:
        client.close()
        ctx.term()
