"""The bench's and the tests' one HTTP client (aegaeon_bench.node.http_client) against a
small aiohttp server on its own thread: replies of any status, errors as the standard
library's clients raise them, and the SSE framing check."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aegaeon_bench.node.http_client import Reply, fetch, fetch_sync, sse_payloads
from aegaeon_bench.node.launch import free_port
from aiohttp import web


async def _echo(request: web.Request) -> web.Response:
    body = await request.json() if request.can_read_body else None
    status = int(request.query.get("status", "200"))
    return web.json_response({"method": request.method, "body": body,
                              "key": request.headers.get("Authorization")}, status=status,
                             headers={"Retry-After": "1"})  # fmt: skip


async def _text(request: web.Request) -> web.Response:
    return web.Response(text="not json", status=503)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The server's URL while the module runs (its loop on a thread of its own)."""
    loop = asyncio.new_event_loop()
    port = free_port()
    app = web.Application()
    app.router.add_route("*", "/echo", _echo)
    app.router.add_get("/text", _text)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_a_reply_of_any_status_with_its_json_text_and_headers(server: str) -> None:
    reply = fetch_sync("PATCH", f"{server}/echo?status=409", {"a": [1]},
                       headers={"Authorization": "Bearer k"})  # fmt: skip
    assert reply.status == 409
    assert reply.json() == {"method": "PATCH", "body": {"a": [1]}, "key": "Bearer k"}
    assert reply.header("retry-after") == "1" and reply.header("X-None", "-") == "-"
    text = fetch_sync("GET", f"{server}/text")
    assert (text.status, text.data(), text.text()) == (503, "not json", "not json")
    with pytest.raises(ValueError):
        text.json()
    assert Reply(204, b"").json() is None


def test_a_refused_connection_is_a_connection_error(server: str) -> None:
    with pytest.raises(ConnectionError, match=r"GET http://127\.0\.0\.1:"):
        fetch_sync("GET", f"http://127.0.0.1:{free_port()}/")


def test_from_a_coroutine_the_sync_form_says_to_await_fetch(server: str) -> None:
    import aiohttp

    async def main() -> Reply:
        with pytest.raises(RuntimeError, match="await fetch"):
            fetch_sync("GET", f"{server}/echo")
        async with aiohttp.ClientSession() as session:
            return await fetch(session, "POST", f"{server}/echo", [1, 2])

    assert asyncio.run(main()).json()["body"] == [1, 2]


def test_sse_payloads_check_the_framing() -> None:
    assert sse_payloads(b'data: {"a": 1}\n\ndata: 2\n\ndata: [DONE]\n\n') == [b'{"a": 1}', b"2"]
    assert sse_payloads(b"data: [DONE]\n\n") == []
    for bad in (b'data: {"a": 1}\n\n', b"data: [DONE]\n", b"data:1\n\ndata: [DONE]\n\n",
                b"data: 1\ndata: 2\n\ndata: [DONE]\n\n", b": hi\n\ndata: [DONE]\n\n"):
        with pytest.raises(ValueError):
            sse_payloads(bad)
