"""The front's defences over a scripted backend: API keys, the admin port, deadlines,
429s, bounded fields, and slow clients (a body a byte at a time, a reader that stops)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aegaeon_common.config import ApiKeyConfig
from aegaeon_proxy.app import make_admin_app, make_app
from aegaeon_proxy.auth import KeyRing
from aegaeon_proxy.server import LINGER_S
from aegaeon_proxy.state import STATE
from aiohttp.test_utils import TestClient, TestServer
from proxy_support import MODEL, Client, ScriptedBackend, scripted_config, sse_chunks

KEY_ALL = "sk-all-0123456789"
KEY_NONE = "sk-other-model-0123"


def _error(data: dict[str, Any], code: str) -> None:
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["code"] == code


def test_key_ring_matches_every_configured_key_and_nothing_else() -> None:
    ring = KeyRing([ApiKeyConfig(KEY_ALL), ApiKeyConfig(KEY_NONE, models=("x",))])
    assert ring.match(f"Bearer {KEY_ALL}") == ApiKeyConfig(KEY_ALL)
    assert ring.match(f"bearer  {KEY_NONE} ").models == ("x",)  # type: ignore[union-attr]
    for header in (None, "", KEY_ALL, f"Basic {KEY_ALL}", f"Bearer {KEY_ALL}x",
                   f"Bearer {KEY_ALL[:-1]}", "Bearer \udcff"):  # fmt: skip
        assert ring.match(header) is None, header
    assert "0123" not in repr(ApiKeyConfig(KEY_ALL))  # never in a log line or traceback


@pytest.mark.proxy(api_keys=(ApiKeyConfig(KEY_ALL), ApiKeyConfig(KEY_NONE, models=("no-such",))))
async def test_api_keys_401_and_models_per_key(client: Client, backend: ScriptedBackend) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    backend.token_ids = [5, 6]
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    _error(await resp.json(), "invalid_api_key")
    resp = await client.post("/v1/completions", json=body,
                             headers={"Authorization": "Bearer sk-wrong-key-123"})  # fmt: skip
    assert resp.status == 401
    for path in ("/v1/models", "/metrics", "/v1/aegaeon/services"):
        assert (await client.get(path)).status == 401, path
    assert (await client.get("/health")).status == 200  # probes stay open
    good = {"Authorization": f"Bearer {KEY_ALL}"}
    assert (await client.post("/v1/completions", json=body, headers=good)).status == 200
    other = {"Authorization": f"Bearer {KEY_NONE}"}
    resp = await client.post("/v1/completions", json=body, headers=other)
    assert resp.status == 404
    _error(await resp.json(), "model_not_found")
    listed = await (await client.get("/v1/models", headers=other)).json()
    assert listed["data"] == []
    assert (await client.get(f"/v1/models/{MODEL}", headers=other)).status == 404
    assert len(backend.submitted) == 1  # refused requests spent nothing


@pytest.mark.proxy(admin_port=0)
async def test_admin_routes_leave_the_public_port(client: Client) -> None:
    async with TestClient(TestServer(make_admin_app(client.app[STATE]))) as admin:
        for path in ("/metrics", "/v1/aegaeon/services"):
            assert (await client.get(path)).status == 404, path
            assert (await admin.get(path)).status == 200, path
        assert (await client.get("/v1/models")).status == 200
        assert (await admin.get("/v1/models")).status == 404
        assert (await admin.get("/health")).status == 200


async def test_a_request_timeout_ends_it_with_deadline_exceeded(
    client: Client, backend: ScriptedBackend
) -> None:
    backend.hang = True  # nothing comes until it is cancelled: only the deadline ends it
    body = {"model": MODEL, "prompt": "x", "timeout": 0.2}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 504
    _error(await resp.json(), "deadline_exceeded")
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    assert resp.status == 200
    _error((await sse_chunks(resp))[-1], "deadline_exceeded")
    assert len(backend.cancelled) == 2  # both freed in the backend
    for bad in (0, -1, "1", True):
        resp = await client.post("/v1/completions", json={**body, "timeout": bad})
        assert resp.status == 400, bad


async def test_stop_and_stop_token_ids_are_bounded(client: Client,
                                                   backend: ScriptedBackend) -> None:  # fmt: skip
    base = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for field, value in (("stop", ["a"] * 17), ("stop", "b" * 257),
                         ("stop_token_ids", list(range(65)))):  # fmt: skip
        resp = await client.post("/v1/completions", json={**base, field: value})
        assert resp.status == 400, field
        assert (await resp.json())["error"]["param"] == field
    assert not backend.submitted


async def _raw_request(port: int, head: bytes, body: bytes,
                       byte_every_s: float) -> tuple[bytes, int]:  # fmt: skip
    """Send ``head``, then ``body`` a byte at a time, reading the answer meanwhile: the
    answer, and how many bytes of the body were sent when it came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    received = bytearray()

    async def read() -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received.extend(chunk)

    reading = asyncio.create_task(read())
    sent = 0
    with contextlib.suppress(ConnectionError):
        for i in range(len(body)):
            if reading.done() or received:
                break
            writer.write(body[i : i + 1])
            await writer.drain()
            sent += 1
            await asyncio.sleep(byte_every_s)
    await asyncio.wait_for(reading, 60.0)  # the server closes the connection
    writer.close()
    return bytes(received), sent


async def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_read_timeout(proxy_market: Path) -> None:
    backend = ScriptedBackend()
    server = TestServer(make_app(scripted_config(proxy_market, read_timeout_s=0.5), backend))
    await server.start_server(lingering_time=LINGER_S)  # as the proxy's server runs
    async with TestClient(server) as client:
        body = json.dumps({"model": MODEL, "prompt": "x" * 200}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        reply, sent = await _raw_request(client.port, head, body, byte_every_s=0.05)  # type: ignore[arg-type]
        assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
        assert b'"code":"body_timeout"' in reply
        assert sent < len(body)  # cut at the read timeout, not read to its end
        assert not backend.submitted


@pytest.mark.proxy(write_timeout_s=0.5)
async def test_a_reader_that_stops_reading_is_cut_and_its_request_freed(
    client: Client, backend: ScriptedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiohttp import web

    original = web.StreamResponse.write
    writes = [0]

    async def stalling_write(self: web.StreamResponse, data: Any) -> None:
        writes[0] += 1
        if writes[0] > 2:  # the client's buffers are full: the write never completes
            await asyncio.Event().wait()
        await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", stalling_write)

    backend.token_ids = list(range(5, 205))
    backend.step_s = 0.01
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with contextlib.suppress(Exception):  # the server cuts the connection
        resp = await client.post("/v1/completions", json=body)
        await resp.read()
    deadline = time.monotonic() + 60.0
    while not backend.cancelled and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert backend.cancelled == [backend.submitted[0].request_id]
    assert backend.played < 200  # cut at the write timeout, before the tokens' end
    assert client.server.app[STATE].metrics.num_open == 0


@pytest.mark.parametrize("field", ["best_of", "tools", "suffix", "use_beam_search"])
async def test_unsupported_features_are_400_not_ignored(client: Client, field: str) -> None:
    value = {"best_of": 3, "tools": [{"type": "function"}], "suffix": "!",
             "use_beam_search": True}[field]  # fmt: skip
    resp = await client.post("/v1/completions",
                             json={"model": MODEL, "prompt": "x", field: value})  # fmt: skip
    assert resp.status == 400 and (await resp.json())["error"]["param"] == field
