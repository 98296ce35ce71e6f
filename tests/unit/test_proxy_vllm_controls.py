"""vLLM's /sleep, /wake_up, /is_sleeping and Ollama's keep_alive, over a scripted
backend that records what the proxy asks of its models."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from aegaeon_common.config import ApiKeyConfig
from aegaeon_proxy.backend import BackendError, ModelOps
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.keep_alive import FOREVER, parse_keep_alive
from proxy_support import MODEL, Client, ScriptedBackend, front, scripted_config


class Controlled(ScriptedBackend, ModelOps):
    """Models on a pretend device; records flags and sleeps (model changes, sleep and wake)."""

    changes_models = True

    def __init__(self) -> None:
        super().__init__()
        self.models = self  # (its own model operations)
        self.resident: set[str] = set()
        self.busy: set[str] = set()  # a device with work of it keeps it through a sleep
        self.calls: list[tuple[str, str, bool]] = []
        self.fail: BackendError | None = None

    async def add_model(self, model: Any) -> None:
        pass

    async def forget_model(self, name: str) -> bool:
        return True

    async def set_model_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        self.calls.append(("flags", name, pinned))

    async def model_cache(self) -> dict[str, Any] | None:
        return None

    async def set_model_awake(self, name: str, awake: bool) -> bool:
        if self.fail is not None:
            raise self.fail
        self.calls.append(("awake", name, awake))
        if awake:
            self.resident.add(name)
        elif name not in self.busy:
            self.resident.discard(name)
        return self.model_sleeping(name)

    def model_sleeping(self, name: str) -> bool:
        return name not in self.resident


@pytest.fixture
def backend() -> Controlled:
    return Controlled()


@pytest.mark.parametrize(("value", "seconds"), [
    (0, 0.0), ("0", 0.0), (30, 30.0), (2.5, 2.5), (-1, FOREVER), ("-1m", FOREVER), ("-1", None),
    ("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("1.5h", 5400.0), ("250ms", 0.25),
    ("2m30s", 150.0), (1e12, FOREVER), ("", None), ("5", None), ("5 m", None), ("m", None),
    (True, None), (None, None), ([], None), (math.inf, None), ("5d", None),
])  # fmt: skip
def test_keep_alive_is_seconds_or_a_go_duration(value: Any, seconds: float | None) -> None:
    if seconds is None:
        with pytest.raises(APIError) as caught:
            parse_keep_alive("keep_alive", value)
        assert caught.value.status == 400 and caught.value.param == "keep_alive"
    else:
        assert parse_keep_alive("keep_alive", value) == seconds


async def test_sleep_is_sleeping_and_wake_up_act_on_the_model(
    client: Client, backend: Controlled
) -> None:
    backend.resident = {MODEL}
    resp = await client.get("/is_sleeping", params={"model": MODEL})
    assert resp.status == 200 and (await resp.json())["is_sleeping"] is False
    resp = await client.post("/sleep", params={"model": MODEL, "level": "1"})
    assert resp.status == 200
    assert await resp.json() == {"is_sleeping": True, "models": {MODEL: True}}
    assert (await (await client.get("/is_sleeping")).json())["is_sleeping"] is True
    resp = await client.post("/wake_up", params={"model": MODEL, "tags": "weights,kv_cache"})
    assert resp.status == 200 and (await resp.json())["is_sleeping"] is False
    # without a model: every served model (vLLM's endpoints name none)
    assert (await (await client.post("/sleep")).json())["models"] == {MODEL: True}
    assert (await (await client.post("/wake_up")).json())["models"] == {MODEL: False}
    assert backend.calls == [("awake", MODEL, False), ("awake", MODEL, True),
                             ("awake", MODEL, False), ("awake", MODEL, True)]  # fmt: skip
    backend.busy = {MODEL}  # work of it on a device: it stays there
    assert (await (await client.post("/sleep")).json())["is_sleeping"] is False
    for method, path, params, status, param in [
        ("POST", "/sleep", {"model": "nope"}, 404, "model"),
        ("GET", "/is_sleeping", {"model": "nope"}, 404, "model"),
        ("POST", "/sleep", {"level": "3"}, 400, "level"),
        ("POST", "/wake_up", {"tags": "weights,gpu"}, 400, "tags"),
    ]:
        resp = await client.request(method, path, params=params)
        assert resp.status == status, path
        assert (await resp.json())["error"]["param"] == param
    backend.fail = BackendError.unavailable("the instances are not all up yet")
    resp = await client.post("/wake_up")
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "unavailable"


@pytest.mark.proxy(api_keys=(ApiKeyConfig(key="user-key-1"),
                             ApiKeyConfig(key="admin-key-1", admin=True)))  # fmt: skip
async def test_controls_need_an_admin_key_when_keys_are_set_and_a_backend_that_sleeps(
    client: Client, backend: Controlled, proxy_market: Path
) -> None:
    assert (await client.post("/sleep")).status == 401
    assert (await client.get("/is_sleeping")).status == 401
    resp = await client.post("/sleep", headers={"Authorization": "Bearer user-key-1"})
    assert resp.status == 403  # a user key: the API only
    assert backend.calls == []
    resp = await client.post("/sleep", headers={"Authorization": "Bearer admin-key-1"})
    assert resp.status == 200
    async with front(scripted_config(proxy_market), ScriptedBackend()) as plain:
        resp = await plain.post("/sleep")
        assert resp.status == 501 and (await resp.json())["error"]["code"] == "not_supported"


async def test_keep_alive_holds_unloads_and_expires(client: Client, backend: Controlled) -> None:
    backend.token_ids = [5, 6]
    backend.resident = {MODEL}

    async def complete(keep_alive: Any) -> int:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "keep_alive": keep_alive}
        resp = await client.post("/v1/completions", json=body)
        return resp.status

    async def settle() -> None:
        for _ in range(5):  # the controls' tasks run
            await asyncio.sleep(0.005)

    assert await complete(-1) == 200  # held: pinned in the Model Cache
    await settle()
    assert backend.calls == [("flags", MODEL, True)]
    resp = await client.patch(f"/v1/aegaeon/models/{MODEL}", json={"pinned": False})
    assert resp.status == 200  # the operator's unpin leaves the keep-alive's hold
    assert backend.calls[-1] == ("flags", MODEL, True)
    backend.calls.clear()
    assert await complete(0) == 200  # unload after it: the hold ends, it sleeps
    await settle()
    assert sorted(backend.calls) == [("awake", MODEL, False), ("flags", MODEL, False)]
    assert MODEL not in backend.resident
    backend.calls.clear()
    assert await complete("500ms") == 200  # held for 0.5 s, then not
    await settle()
    assert backend.calls == [("flags", MODEL, True)]
    await asyncio.sleep(0.8)
    assert backend.calls == [("flags", MODEL, True), ("flags", MODEL, False)]
    backend.calls.clear()
    assert await complete("2s") == 200
    assert await complete("1h") == 200  # the last request wins: no expiry in 2 s
    await settle()
    assert backend.calls == [("flags", MODEL, True)]
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "keep_alive": "soon"})  # fmt: skip
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "keep_alive"
    assert await complete(None) == 200  # absent: nothing changes
