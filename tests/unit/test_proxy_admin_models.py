"""Model lifecycle on the admin API (``/v1/aegaeon/models``) over a scripted backend:
body validation, add / change / remove, max_concurrency, removal after in-flight
requests. The real node is exercised in tests/e2e/test_serve_models.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aegaeon_common.config import Config, ModelConfig, ModelSettings
from aegaeon_common.http_side import ServiceAddress, write_http_address
from aegaeon_proxy.admin_models import parse_settings, quarantine
from aegaeon_proxy.backend import BackendError, ModelOps
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.state import STATE
from proxy_support import MODEL, Client, ScriptedBackend, front, market_dir

EXTRA = "mistral-11m"  # in the market, not configured


class ControlledBackend(ScriptedBackend, ModelOps):
    """The scripted backend plus a Model Cache of its own (test double of a backend that
    changes its models and reads them again)."""

    changes_models = True

    def __init__(self) -> None:
        super().__init__()
        self.models = self  # (its own model operations)
        self.calls: list[tuple[Any, ...]] = []
        self.resident: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.fail_add: BackendError | None = None
        self.fail_reload: BackendError | None = None
        self.apply: Any = None

    def follow_unavailable(self, apply: Any) -> None:
        self.apply = apply

    async def quarantine_model(self, name: str, why: str | None) -> None:
        self.calls.append(("quarantine", name, why))
        self.apply(name, why)

    async def reload_model(self, model: ModelConfig) -> None:
        self.calls.append(("reload", model.name))
        if self.fail_reload is not None:
            self.apply(model.name, None)
            self.apply(model.name, self.fail_reload.message)
            raise self.fail_reload
        self.apply(model.name, None)

    async def add_model(self, model: ModelConfig) -> None:
        self.calls.append(("add", model.name))
        if self.fail_add is not None:
            raise self.fail_add

    async def forget_model(self, name: str) -> bool:
        self.calls.append(("forget", name))
        self.pinned.discard(name)
        return self.resident.pop(name, None) is not None

    async def set_model_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        self.calls.append(("flags", name, pinned, preload))
        if pinned or preload:
            self.resident[name] = 1000
        (self.pinned.add if pinned else self.pinned.discard)(name)

    async def model_cache(self) -> dict[str, Any] | None:
        return {
            "budget_bytes": 10_000, "used_bytes": sum(self.resident.values()),
            "models": [{"name": n, "nbytes": b, "pins": 0} for n, b in self.resident.items()],
            "loading": [], "progress": {}, "num_loads": 0, "num_hits": 0, "num_evictions": 0,
            "operator_pinned": sorted(self.pinned), "known": [],
        }  # fmt: skip


@pytest.fixture
def backend() -> ControlledBackend:
    backend = ControlledBackend()
    assert backend.changes_models and not ScriptedBackend().models.changes_models
    return backend


@pytest.fixture
def settings() -> dict[str, ModelSettings]:
    return {}


@pytest.fixture
def proxy_config(settings: dict[str, ModelSettings]) -> Config:
    """One model served, the market's others to add, ``settings`` for the models."""
    market = market_dir()
    return Config(models=(ModelConfig(MODEL, market / MODEL),), market_dir=market,
                  model_settings=settings)  # fmt: skip


def _error(body: dict[str, Any]) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


# ---- validation (no server) ----------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"pinned": 1}, "pinned"),
        ({"pin": "yes"}, "pin"),
        ({"preload": None}, "preload"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": 2.5}, "max_concurrency"),
        ({"max_concurrency": True}, "max_concurrency"),
        ({"slo_classes": "batch"}, "slo_classes"),
        ({"slo_classes": ["urgent"]}, "slo_classes"),
        ({"min_ttft_ms": -1}, "min_ttft_ms"),
        ({"colour": "red"}, "colour"),
        ({"pin": True, "pinned": False}, "pinned"),
    ],
)
def test_bad_fields_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_settings(body)
    assert info.value.status == 400
    assert info.value.param == param


def test_settings_are_normalized() -> None:
    changes = parse_settings({"pinned": True, "max_concurrency": None, "min_tbt_ms": 50,
                              "slo_classes": ["batch", "batch", "standard"]})  # fmt: skip
    assert changes == {"pin": True, "max_concurrency": None, "min_tbt_s": 0.05,
                       "slo_classes": ("batch", "standard")}  # fmt: skip
    assert parse_settings({"name": "x"}, extra=("name",)) == {}


# ---- the endpoints -------------------------------------------------------------
@pytest.mark.parametrize("settings", [
    {MODEL: ModelSettings(pin=True, max_concurrency=3, slo_classes=("standard",))}],
    ids=["configured"])  # fmt: skip
async def test_list_shows_settings_and_cache_state(client: Client,
                                                   backend: ControlledBackend) -> None:  # fmt: skip
    backend.resident[MODEL] = 1234
    resp = await client.get("/v1/aegaeon/models")
    assert resp.status == 200
    body = await resp.json()
    (row,) = body["data"]
    assert row["name"] == MODEL and row["state"] == "serving" and row["source"] == "config"
    assert row["pinned"] is True and row["max_concurrency"] == 3
    assert row["slo_classes"] == ["standard"]
    assert row["in_model_cache"] is True and row["load_progress"] == 1.0
    assert row["bytes"] == 1234
    assert body["model_cache"]["budget_bytes"] == 10_000
    one = await client.get(f"/v1/aegaeon/models/{MODEL}")
    assert (await one.json())["name"] == MODEL
    missing = await client.get("/v1/aegaeon/models/nope")
    assert missing.status == 404


async def test_patch_validates_and_applies(client: Client, backend: ControlledBackend) -> None:
    url = f"/v1/aegaeon/models/{MODEL}"
    bad = await client.patch(url, json={"max_concurrency": "many"})
    assert bad.status == 400
    assert _error(await bad.json())["param"] == "max_concurrency"
    unknown = await client.patch(url, json={"speed": 3})
    assert unknown.status == 400 and _error(await unknown.json())["param"] == "speed"
    not_json = await client.patch(url, data=b"[1]")
    assert not_json.status == 400
    gone = await client.patch("/v1/aegaeon/models/nope", json={"pin": True})
    assert gone.status == 404
    assert _error(await gone.json())["code"] == "model_not_found"
    assert backend.calls == []  # nothing bad reached the cachemgr

    resp = await client.patch(url, json={"pinned": True, "slo_classes": ["batch"]})
    assert resp.status == 200
    row = await resp.json()
    assert row["pinned"] is True and row["slo_classes"] == ["batch"]
    assert row["in_model_cache"] is True
    assert backend.calls == [("flags", MODEL, True, False)]
    # a change that is not a flag does not touch the cachemgr; others keep their value
    resp = await client.patch(url, json={"max_concurrency": 7})
    row = await resp.json()
    assert row["max_concurrency"] == 7 and row["pinned"] is True
    assert len(backend.calls) == 1
    state = client.app[STATE]
    assert state.models.settings(MODEL).max_concurrency == 7  # what admission reads


async def test_max_concurrency_refuses_past_the_bound_at_once(
    client: Client, backend: ControlledBackend
) -> None:
    backend.hang = True
    await client.patch(f"/v1/aegaeon/models/{MODEL}", json={"max_concurrency": 1})
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    first = asyncio.ensure_future(client.post("/v1/completions", json=body))
    while not backend.submitted:
        await asyncio.sleep(0.01)
    second = await client.post("/v1/completions", json=body)
    assert second.status == 429
    assert _error(await second.json())["code"] == "overloaded"
    await client.patch(f"/v1/aegaeon/models/{MODEL}", json={"max_concurrency": None})
    backend.hang = False
    backend.token_ids = [5, 6]
    third = await client.post("/v1/completions", json=body)  # unbounded again
    assert third.status == 200
    first.cancel()


async def test_add_then_remove_a_market_model(client: Client, backend: ControlledBackend) -> None:
    backend.token_ids = [7, 8, 9]
    body = {"model": EXTRA, "prompt": "Hi", "max_tokens": 3}
    assert (await client.post("/v1/completions", json=body)).status == 404
    missing = await client.post("/v1/aegaeon/models", json={"name": "not-in-market"})
    assert missing.status == 404
    assert _error(await missing.json())["code"] == "model_not_in_market"
    bad = await client.post("/v1/aegaeon/models", json={"name": EXTRA, "pin": "x"})
    assert bad.status == 400 and _error(await bad.json())["param"] == "pin"
    no_name = await client.post("/v1/aegaeon/models", json={"pin": True})
    assert no_name.status == 400 and _error(await no_name.json())["param"] == "name"
    dup = await client.post("/v1/aegaeon/models", json={"name": MODEL})
    assert dup.status == 409

    added = await client.post("/v1/aegaeon/models",
                              json={"name": EXTRA, "preload": True, "max_concurrency": 2})
    assert added.status == 201, await added.text()
    row = await added.json()
    assert row["state"] == "serving" and row["source"] == "runtime"
    assert row["preload"] is True and row["max_concurrency"] == 2
    assert ("add", EXTRA) in backend.calls and ("flags", EXTRA, False, True) in backend.calls
    listed = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
    assert listed == [MODEL, EXTRA]
    assert (await client.post("/v1/completions", json=body)).status == 200
    assert (await client.post("/v1/aegaeon/models", json={"name": EXTRA})).status == 409

    gone = await client.delete(f"/v1/aegaeon/models/{EXTRA}")
    assert gone.status == 200
    assert (await gone.json())["state"] == "removed"
    assert backend.calls[-1] == ("forget", EXTRA)
    assert (await client.post("/v1/completions", json=body)).status == 404
    assert (await client.get(f"/v1/models/{EXTRA}")).status == 404
    names = [m["name"] for m in (await (await client.get("/v1/aegaeon/models")).json())["data"]]
    assert names == [MODEL]
    assert (await client.delete(f"/v1/aegaeon/models/{EXTRA}")).status == 404


async def test_a_failed_add_leaves_nothing(client: Client, backend: ControlledBackend) -> None:
    backend.fail_add = BackendError("the instances are not all up yet")
    resp = await client.post("/v1/aegaeon/models", json={"name": EXTRA})
    assert resp.status == 503
    assert _error(await resp.json())["code"] == "unavailable"
    assert backend.calls[-1] == ("forget", EXTRA)
    listed = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
    assert listed == [MODEL]
    backend.fail_add = None
    assert (await client.post("/v1/aegaeon/models", json={"name": EXTRA})).status == 201


async def test_an_unreadable_model_is_listed_unavailable_until_a_reload_reads_it(
    client: Client, backend: ControlledBackend
) -> None:
    backend.token_ids = [7, 8]
    why = "/m/mistral-11m/model.safetensors: file truncated inside the tensor data"
    backend.fail_add = BackendError(why, status=422, code="model_unavailable")
    resp = await client.post("/v1/aegaeon/models", json={"name": EXTRA})
    assert resp.status == 422
    err = _error(await resp.json())
    assert err["code"] == "model_unavailable" and why in err["message"]
    assert "reload" in err["message"]
    assert ("quarantine", EXTRA, why) in backend.calls
    # listed, with its state and why
    models = {m["id"]: m for m in (await (await client.get("/v1/models")).json())["data"]}
    assert models[EXTRA]["state"] == "unavailable" and models[EXTRA]["error"] == why
    assert models[MODEL]["state"] == "serving" and "error" not in models[MODEL]
    row = await (await client.get(f"/v1/aegaeon/models/{EXTRA}")).json()
    assert row["state"] == "unavailable" and row["error"] == why
    metrics = await (await client.get("/metrics")).text()
    assert "aegaeon_models_unavailable 1.0" in metrics
    # its requests: 503 naming the file; the other model's as before
    body = {"model": EXTRA, "prompt": "Hi", "max_tokens": 2}
    refused = await client.post("/v1/completions", json=body)
    assert refused.status == 503
    err = _error(await refused.json())
    assert err["code"] == "model_unavailable" and why in err["message"]
    assert err["type"] == "service_unavailable"
    ok = await client.post("/v1/completions", json={**body, "model": MODEL})
    assert ok.status == 200
    again = await client.post("/v1/aegaeon/models", json={"name": EXTRA})
    assert again.status == 409 and "reload" in _error(await again.json())["message"]
    # still broken: a reload says what is wrong now, and it stays unavailable
    now = "/m/mistral-11m/model.safetensors: missing file"
    backend.fail_reload = BackendError(now, status=422, code="model_unavailable")
    failed = await client.post(f"/v1/aegaeon/models/{EXTRA}/reload")
    assert failed.status == 422 and now in _error(await failed.json())["message"]
    row = await (await client.get(f"/v1/aegaeon/models/{EXTRA}")).json()
    assert row["state"] == "unavailable" and row["error"] == now
    # fixed: served again
    backend.fail_reload = None
    fixed = await client.post(f"/v1/aegaeon/models/{EXTRA}/reload")
    assert fixed.status == 200, await fixed.text()
    row = await fixed.json()
    assert row["state"] == "serving" and row["error"] is None
    assert (await client.post("/v1/completions", json=body)).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert "aegaeon_models_unavailable 0.0" in metrics
    assert (await client.post("/v1/aegaeon/models/nope/reload")).status == 404
    # removed while unavailable: lifted once forgotten, so a later add starts afresh
    backend.fail_reload = BackendError(now, status=422, code="model_unavailable")
    assert (await client.post(f"/v1/aegaeon/models/{EXTRA}/reload")).status == 422
    assert (await client.delete(f"/v1/aegaeon/models/{EXTRA}")).status == 200
    assert backend.calls[-2:] == [("forget", EXTRA), ("quarantine", EXTRA, None)]
    backend.fail_add = None
    added = await client.post("/v1/aegaeon/models", json={"name": EXTRA})
    assert added.status == 201 and (await added.json())["state"] == "serving"


async def test_remove_waits_for_requests_in_flight(client: Client,
                                                   backend: ControlledBackend) -> None:  # fmt: skip
    backend.token_ids = [7, 8, 9]
    backend.step_s = 0.2
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    running = asyncio.ensure_future(client.post("/v1/completions", json=body))
    while not backend.submitted:
        await asyncio.sleep(0.01)
    resp = await client.delete(f"/v1/aegaeon/models/{MODEL}")
    assert resp.status == 202
    assert (await resp.json())["state"] == "removing"
    assert ("forget", MODEL) not in backend.calls
    assert (await client.post("/v1/completions", json=body)).status == 404  # new ones: 404
    patch = await client.patch(f"/v1/aegaeon/models/{MODEL}", json={"pin": True})
    assert patch.status == 409
    finished = await running  # the one in flight completes
    assert finished.status == 200
    assert len((await finished.json())["choices"][0]["text"]) >= 0
    state = client.app[STATE]
    while state.models.get(MODEL) is not None:
        await asyncio.sleep(0.01)
    assert backend.calls[-1] == ("forget", MODEL)


async def test_a_backend_without_the_optional_operations(tmp_path: Path) -> None:
    """ScriptedBackend overrides none of them: changes, reloads and sleep are 501
    ``not_supported`` (nothing done), the live limits still apply, no detailed stats
    (404), the run directory's services, a quarantine on this proxy alone."""
    market = market_dir()
    config = Config(models=(ModelConfig(MODEL, market / MODEL),), market_dir=market,
                    run_dir=tmp_path)  # fmt: skip
    write_http_address(tmp_path, ServiceAddress("cachemgr", "cachemgr", "http://cm"))

    async with front(config, ScriptedBackend()) as client:
        for resp in (await client.post("/v1/aegaeon/models", json={"name": EXTRA}),
                     await client.patch(f"/v1/aegaeon/models/{MODEL}", json={"pin": True}),
                     await client.delete(f"/v1/aegaeon/models/{MODEL}"),
                     await client.post(f"/v1/aegaeon/models/{MODEL}/reload"),
                     await client.get("/is_sleeping")):  # fmt: skip
            assert resp.status == 501, await resp.text()
            assert _error(await resp.json())["code"] == "not_supported"
        ok = await client.patch(f"/v1/aegaeon/models/{MODEL}", json={"max_concurrency": 2})
        assert ok.status == 200
        row = (await (await client.get("/v1/aegaeon/models")).json())["data"][0]
        assert row["max_concurrency"] == 2 and row["in_model_cache"] is None
        assert row["state"] == "serving"  # the refused DELETE removed nothing
        assert (await client.get("/v1/aegaeon/stats")).status == 404
        services = (await (await client.get("/v1/aegaeon/services")).json())["services"]
        assert [(s["name"], s["health_url"]) for s in services] == [
            ("cachemgr", "http://cm/health")]  # fmt: skip
        state = client.app[STATE]
        await quarantine(state, MODEL, "model.safetensors: truncated")
        assert state.models.unavailable(MODEL) == "model.safetensors: truncated"
        await quarantine(state, MODEL, None)
        assert state.models.unavailable(MODEL) is None
