"""Slow clients against a live proxy: what they cost and when they are cut.

Two kinds, ``count`` of each at once: a reader that asks for a long stream
and never reads it (a 4 KiB receive buffer: the proxy's writes stop completing
once the kernel buffers are full), and a writer that sends its body one byte a
second. Reports the proxy's RSS before and at its peak, and how long the proxy
took to cut each connection (it closes it: ``proxy.write_timeout`` after a write
stopped completing, ``proxy.read_timeout`` after a body began to arrive).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from typing import Any

import psutil

__all__ = ["slow_clients"]

HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: aegaeon\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n")  # fmt: skip


def _head(body: bytes, api_key: str | None) -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    return HEAD % (auth, len(body))


async def _never_reads(host: str, port: int, body: bytes, limit_s: float,
                       api_key: str | None = None) -> tuple[float | None, str]:  # fmt: skip
    """Seconds until the proxy let go of a stream nobody reads (None: not within
    limit_s), and the status line the client had received by then."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, _head(body, api_key) + body)
    start = time.monotonic()
    cut: float | None = None
    try:
        # the client never reads; it watches for the peer's close: its own socket's
        # state (RST, or FIN when one fits the window) or the proxy's end of it
        while time.monotonic() - start < limit_s:
            await asyncio.sleep(0.5)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
            if err or info[0] in (7, 8) or _server_let_go(sock.getsockname()[:2]):
                cut = time.monotonic() - start  # TCP_CLOSE / TCP_CLOSE_WAIT, or the proxy's
                break
        try:
            head = sock.recv(12, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            head = b""
        return cut, head.decode("latin-1")[9:12] or "none"
    finally:
        sock.close()


def _server_let_go(client: tuple[str, int]) -> bool:
    """Whether the proxy's end of the connection from ``client`` left ESTABLISHED."""
    ends = [c for c in psutil.net_connections(kind="tcp") if c.raddr and tuple(c.raddr) == client]
    return not ends or ends[0].status != psutil.CONN_ESTABLISHED


async def _trickles(host: str, port: int, body: bytes, every_s: float, limit_s: float,
                    api_key: str | None = None) -> float | None:  # fmt: skip
    """Seconds until the proxy answered (408) and closed a body sent a byte at a time."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_head(body, api_key))
    start = time.monotonic()
    reply = asyncio.create_task(reader.read())
    try:
        for i in range(len(body)):
            if reply.done() or time.monotonic() - start > limit_s:
                break
            writer.write(body[i : i + 1])
            try:
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(every_s)
        data = await asyncio.wait_for(reply, max(1.0, limit_s - (time.monotonic() - start)))
        return time.monotonic() - start if data.startswith(b"HTTP/1.1 408") else None
    except (TimeoutError, ConnectionError):
        return None
    finally:
        writer.close()


async def slow_clients(base_url: str, serve_pid: int, model: str, count: int,
                       max_tokens: int, limit_s: float = 300.0,
                       api_key: str | None = None) -> dict[str, Any]:  # fmt: skip
    from aegaeon_bench.node.probe import sample_processes

    host, port = base_url.removeprefix("http://").split(":")
    long_stream = json.dumps({"model": model, "prompt": "Tell me a long story.", "stream": True,
                              "max_tokens": max_tokens, "ignore_eos": True}).encode()
    trickle = json.dumps({"model": model, "prompt": "x" * 200}).encode()
    before = sample_processes(serve_pid)["proxy"].rss_bytes
    peak = [before]

    async def watch() -> None:
        while True:
            peak.append(sample_processes(serve_pid)["proxy"].rss_bytes)
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    start = time.monotonic()
    readers = [_never_reads(host, int(port), long_stream, limit_s, api_key)
               for _ in range(count)]  # fmt: skip
    writers = [_trickles(host, int(port), trickle, 1.0, limit_s, api_key) for _ in range(count)]
    results = await asyncio.gather(*readers, *writers)
    watcher.cancel()
    reader_results = [r for r in results[:count] if isinstance(r, tuple)]
    cut_readers = [r[0] for r in reader_results if r[0] is not None]
    cut_writers = [r for r in results[count:] if isinstance(r, float)]
    return {
        "count": count,
        "max_tokens": max_tokens,
        "proxy_rss_before_mib": round(before / 2**20, 1),
        "proxy_rss_peak_mib": round(max(peak) / 2**20, 1),
        "readers_status": dict(Counter(r[1] for r in reader_results)),
        "readers_cut": len(cut_readers),
        "readers_cut_after_s": [round(min(cut_readers), 1), round(max(cut_readers), 1)]
        if cut_readers else None,
        "writers_cut": len(cut_writers),
        "writers_cut_after_s": [round(min(cut_writers), 1), round(max(cut_writers), 1)]
        if cut_writers else None,
        "limit_s": limit_s,
        "seconds": round(time.monotonic() - start, 1),
    }  # fmt: skip
