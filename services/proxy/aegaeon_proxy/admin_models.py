"""Model lifecycle on the admin API: ``/v1/aegaeon/models``.

* ``GET /v1/aegaeon/models`` (and ``/{model}``): every model the proxy knows,
  with its live settings and its Model Cache state.
* ``PATCH /v1/aegaeon/models/{model}``: change ``pinned`` (or ``pin``),
  ``preload``, ``max_concurrency``, ``slo_classes``, ``min_ttft_ms``,
  ``min_tbt_ms``; applied at once (the cachemgr's flags; the next request reads
  the rest from the :class:`~aegaeon_proxy.model_table.ModelSettingsTable`).
* ``POST /v1/aegaeon/models`` ``{"name", ...settings}``: serve a model of the
  market folder (``market.json`` read again) without a restart: the cachemgr
  registers it, every instance reads it, the proxy loads its tokenizer.
* ``DELETE /v1/aegaeon/models/{model}``: new requests get 404 at once; the
  cachemgr forgets it (its Model Cache bytes freed) once its requests in
  flight have ended: 200 when that is now, else 202 (``state: removing``).
* ``POST /v1/aegaeon/models/{model}/reload``: read a model's checkpoint again
  (its tokenizer here, its files on every node, each instance that lacks it):
  an *unavailable* model (its checkpoint could not be read: listed with
  ``state: unavailable`` and the ``error``, its requests answered 503
  ``model_unavailable``) is served again once its files are fixed.

A checkpoint that cannot be read makes the model unavailable wherever it was
found (an add, a pin or preload, a reload, a request): an add or a reload
answers 422 ``model_unavailable`` naming the file, and the model stays listed
as unavailable until a reload succeeds (or it is deleted).

Errors are OpenAI error objects: 400 naming the field, 404 unknown model,
409 a model already served (or being added or removed) or a pin that does not
fit the Model Cache, 422 a checkpoint that cannot be served, 501 a backend
that cannot change its models, 503 instances not up.

Replicated proxies (``aegaeon serve --proxies N`` over a shared store) take
every one of these: the replica that is asked tells every node's cachemgr and
instances, and publishes the change in the store; the other replicas' tables
follow it (:func:`follow_served`, as ``PATCH``'s settings do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from aegaeon_common.config import SLO_CLASS_NAMES, ConfigError, ModelConfig, market_models
from aegaeon_common.logs import get_logger
from aiohttp import web
from aiohttp.typedefs import Handler

from aegaeon_proxy.assets import AssetError
from aegaeon_proxy.backend import NOT_SUPPORTED, BackendError, ModelOps
from aegaeon_proxy.errors import APIError, backend_api_error, invalid
from aegaeon_proxy.http_io import read_json_object
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.model_table import LiveModel, ModelSettingsTable
from aegaeon_proxy.params import check_bool
from aegaeon_proxy.state import STATE, ProxyState

log = get_logger("proxy")

__all__ = ["ROUTES", "follow_served", "model_rows", "parse_settings", "quarantine",
           "remove_model", "serve_model", "unknown_model"]  # fmt: skip


# ---- request bodies ----------------------------------------------------------
def _concurrency(param: str, value: Any) -> int | None:
    if value is None:
        return None  # unbounded
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(param, f"'{param}' must be an integer >= 1 or null (unbounded)")
    return value


def _classes(param: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()  # every class
    names = ", ".join(SLO_CLASS_NAMES)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(param, f"'{param}' must be a list of SLO class names ({names}) or null")
    unknown = [v for v in value if v not in SLO_CLASS_NAMES]
    if unknown:
        raise invalid(param, f"'{param}': {unknown[0]!r} is not an SLO class ({names})")
    return tuple(dict.fromkeys(value))


def _ms(param: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise invalid(param, f"'{param}' must be a number of milliseconds > 0 or null")
    return float(value) / 1000.0


# request field -> (ModelSettings field, checker)
FIELDS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "pinned": ("pin", check_bool),
    "pin": ("pin", check_bool),
    "preload": ("preload", check_bool),
    "max_concurrency": ("max_concurrency", _concurrency),
    "slo_classes": ("slo_classes", _classes),
    "min_ttft_ms": ("min_ttft_s", _ms),
    "min_tbt_ms": ("min_tbt_s", _ms),
}


def parse_settings(body: Mapping[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ModelSettings changes ``body`` asks for; a 400 naming the first bad field
    (unknown, wrong type, out of range; ``pin`` and ``pinned`` disagreeing)."""
    changes: dict[str, Any] = {}
    for key, value in body.items():
        if key in extra:
            continue
        if key not in FIELDS:
            known = ", ".join((*extra, *FIELDS))
            raise APIError(400, f"unknown field '{key}' (known: {known})", param=key,
                           code="unknown_parameter")  # fmt: skip
        field, check = FIELDS[key]
        normalized = check(key, value)
        if field in changes and changes[field] != normalized:
            raise invalid(key, "'pin' and 'pinned' disagree")
        changes[field] = normalized
    return changes


# ---- answers -----------------------------------------------------------------
def _ms_of(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def model_row(table: ModelSettingsTable, entry: LiveModel,
              cache: Mapping[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """One model as the admin API shows it; ``cache``: the Model Cache's stats (None:
    not known, then the cache fields are null)."""
    s = entry.settings
    row: dict[str, Any] = {
        "name": entry.name,
        "object": "aegaeon.model",
        "state": table.state_of(entry),  # adding | serving | unavailable | removing
        "error": table.unavailable(entry.name),  # why it is unavailable (null: it is not)
        "source": "runtime" if entry.runtime else "config",
        "path": str(entry.config.path),
        "base": entry.config.base,  # a LoRA adapter's base; null for a model
        "pinned": s.pin,
        "preload": s.preload,
        "max_concurrency": s.max_concurrency,  # null: unbounded
        "slo_classes": list(s.slo_classes),  # []: every class
        "min_ttft_ms": _ms_of(s.min_ttft_s),
        "min_tbt_ms": _ms_of(s.min_tbt_s),
        "in_flight": entry.in_flight,
        "in_model_cache": None,
        "loading": None,
        "load_progress": None,
        "bytes": None,
    }
    if cache is not None:
        resident = {m["name"]: m for m in cache.get("models", [])}
        loading = entry.name in cache.get("loading", [])
        model = resident.get(entry.name)
        progress = 1.0 if model is not None else cache.get("progress", {}).get(entry.name, 0.0)
        row.update(in_model_cache=model is not None, loading=loading,
                   load_progress=float(progress),
                   bytes=int(model["nbytes"]) if model is not None else None)  # fmt: skip
    return row


def model_rows(table: ModelSettingsTable, cache: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [model_row(table, entry, cache) for entry in table]


def _cache_summary(cache: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if cache is None:
        return None
    keys = ("budget_bytes", "used_bytes", "num_loads", "num_hits", "num_evictions")
    return {k: cache.get(k) for k in keys}


def _control(state: ProxyState) -> ModelOps:
    """The backend's models, when it changes them at run time (else 501, before any
    work)."""
    models = state.backend.models
    if not models.changes_models:
        raise APIError(501, "this backend cannot change its models at run time",
                       code=NOT_SUPPORTED)  # fmt: skip
    return models


def _backend_error(exc: BackendError, name: str | None = None) -> APIError:
    if exc.code == "model_unavailable" and name is not None:
        return _unreadable(name, exc.message)
    return backend_api_error(exc)


def _unreadable(name: str, why: str) -> APIError:
    """An admin operation met ``name``'s unreadable checkpoint (it is unavailable now)."""
    return APIError(422, f"model '{name}' cannot be served: {why}; it is listed as "
                    f"unavailable until POST /v1/aegaeon/models/{name}/reload reads it again "
                    "(fix the file first) or it is deleted", param="name",
                    code="model_unavailable")  # fmt: skip


async def quarantine(state: ProxyState, name: str, why: str | None) -> None:
    """``name`` unavailable (``why``) or available again (None), on every replica (the
    backend's); on this one alone when the backend does not share it or cannot now."""
    try:
        await state.backend.models.quarantine_model(name, why)
    except BackendError as exc:  # (the store is down: this replica knows, at least)
        log.warning("model_quarantine_not_shared", model=name, error=exc.message)
        state.models.follow_unavailable(name, why)


def unknown_model(name: str) -> APIError:
    """A 404 for a model this proxy does not serve (or is still adding)."""
    return APIError(404, f"no model '{name}' is served", param="model", code="model_not_found")


def _entry(state: ProxyState, name: str) -> LiveModel:
    entry = state.models.get(name)
    if entry is None or entry.state == "adding":
        raise unknown_model(name)
    return entry


# ---- handlers ----------------------------------------------------------------
async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/aegaeon/models``."""
    state = request.app[STATE]
    cache = await state.backend.models.model_cache()
    return json_response({"object": "list", "data": model_rows(state.models, cache),
                          "model_cache": _cache_summary(cache)})  # fmt: skip


async def get_model(request: web.Request) -> web.Response:
    """``GET /v1/aegaeon/models/{model}``."""
    state = request.app[STATE]
    entry = _entry(state, request.match_info["model"])
    return json_response(model_row(state.models, entry, await state.backend.models.model_cache()))


async def patch_model(request: web.Request) -> web.Response:
    """``PATCH /v1/aegaeon/models/{model}``: change its settings now."""
    state = request.app[STATE]
    name = request.match_info["model"]
    entry = _entry(state, name)
    changes = parse_settings(await read_json_object(request))
    if entry.state == "removing":
        raise APIError(409, f"model '{name}' is being removed", code="model_removing")
    settings = state.models.replaced(name, changes)
    if "pin" in changes or "preload" in changes:
        # a request's keep_alive may hold it too (aegaeon_proxy.keep_alive)
        pinned = settings.pin or state.keep_alive.held(name)
        try:
            await state.backend.models.set_model_flags(
                name, pinned=pinned, preload=changes.get("preload") is True
            )
        except BackendError as exc:
            if exc.code == "model_unavailable":
                await quarantine(state, name, exc.message)
            raise _backend_error(exc, name) from None
    if state.models.get(name) is not entry:
        raise unknown_model(name)  # removed meanwhile
    # fields not in the body keep their value of now (another PATCH may have run)
    settings = msgspec.structs.replace(entry.settings, **changes)
    state.models.update(name, settings)
    await state.backend.models.publish_model_settings(name, settings)  # the other replicas
    log.info("model_settings_changed", model=name, **{k: str(v) for k, v in changes.items()})
    return json_response(model_row(state.models, entry, await state.backend.models.model_cache()))


async def add_model(request: web.Request) -> web.Response:
    """``POST /v1/aegaeon/models`` ``{"name": ..., settings}``: serve a model of the market."""
    state = request.app[STATE]
    body = await read_json_object(request)
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("name", "'name' must be the name of a model in the market folder")
    changes = parse_settings(body, extra=("name",))
    existing = state.models.get(name)
    if existing is not None:
        code = "model_exists" if existing.state == "serving" else f"model_{existing.state}"
        hint = ""
        if state.models.unavailable(name) is not None:
            hint = f" (unavailable: POST /v1/aegaeon/models/{name}/reload reads it again)"
        raise APIError(409, f"model '{name}' is already {existing.state}{hint}", param="name",
                       code=code)  # fmt: skip
    _control(state)
    market = state.config.market_dir
    if market is None:
        raise APIError(404, "this deployment names no market folder (`market:`)",
                       param="name", code="model_not_in_market")  # fmt: skip
    try:
        offered = await asyncio.to_thread(market_models, market)
    except ConfigError as exc:
        raise APIError(500, f"the market cannot be read: {exc}", code="market_unreadable") from None
    model = next((m for m in offered if m.name == name), None)
    if model is None:
        raise APIError(404, f"model '{name}' is not in the market folder {market}",
                       param="name", code="model_not_in_market")  # fmt: skip
    if model.base is not None and model.base not in state.models.bases():
        raise APIError(409, f"model '{name}' is a LoRA adapter of '{model.base}', which is not "
                       "served (add it first)", param="name", code="base_not_served")
    entry = await serve_model(state, model, changes)
    cache = await state.backend.models.model_cache()
    return json_response(model_row(state.models, entry, cache), status=201)


async def serve_model(state: ProxyState, model: ModelConfig,
                      changes: Mapping[str, Any]) -> LiveModel:
    """Serve ``model`` from now on with the settings ``changes`` (the admin API's add and
    vLLM's ``/v1/load_lora_adapter``): its text assets, every cachemgr and instance, the
    other replicas. APIError when it cannot be (nothing of it stays then)."""
    name = model.name
    control = _control(state)
    settings = msgspec.structs.replace(state.models.defaults, **changes)
    entry = state.models.begin_add(model, settings)
    registered = False
    try:
        state.assets.add(model)
        await state.assets.get(name)  # tokenizer, template, window: a broken one fails here
        registered = True
        await control.add_model(model)
        if settings.pin or settings.preload:
            await control.set_model_flags(name, pinned=settings.pin, preload=settings.preload)
        if changes:  # the other replicas: its settings before it is served there
            await control.publish_model_settings(name, settings)
        await control.publish_served(name, model)  # every other replica serves it too
    except (AssetError, BackendError) as exc:
        if isinstance(exc, AssetError) or exc.code == "model_unavailable":
            # its checkpoint cannot be read: listed, unavailable, until a reload
            why = exc.message if isinstance(exc, BackendError) else str(exc)
            await _add_unavailable(state, model, why)
            raise _unreadable(name, why) from None
        state.assets.remove(name)
        state.models.drop(name)
        if registered:
            await _forget(control, name)
        log.error("model_add_failed", model=name, error=str(exc))
        raise _backend_error(exc) from None
    except BaseException:
        state.assets.remove(name)
        state.models.drop(name)
        raise
    state.models.finish_add(name)
    log.info("model_added", model=name, path=str(model.path), base=model.base)
    return entry


async def _add_unavailable(state: ProxyState, model: ModelConfig, why: str) -> None:
    """An add whose checkpoint cannot be read: the model is listed (on every replica),
    unavailable, so that fixing the file and reloading it serves it."""
    log.error("model_add_failed", model=model.name, error=why, listed="unavailable")
    await quarantine(state, model.name, why)
    state.models.finish_add(model.name)
    try:
        await state.backend.models.publish_served(model.name, model)
    except BackendError as exc:
        log.warning("model_add_not_shared", model=model.name, error=exc.message)


async def reload_model(request: web.Request) -> web.Response:
    """``POST /v1/aegaeon/models/{model}/reload``: read its checkpoint again (tokenizer,
    files on every node, instances that lack it): 200 and its row once it serves, 422
    ``model_unavailable`` (it stays unavailable) naming what is still wrong."""
    state = request.app[STATE]
    name = request.match_info["model"]
    entry = _entry(state, name)
    if entry.state == "removing":
        raise APIError(409, f"model '{name}' is being removed", code="model_removing")
    state.assets.remove(name)  # its tokenizer and template read again too
    state.assets.add(entry.config)
    try:
        await state.assets.get(name)
    except AssetError as exc:
        await quarantine(state, name, str(exc))
        raise _unreadable(name, str(exc)) from None
    try:
        await state.backend.models.reload_model(entry.config)  # (unavailable again: it says)
    except BackendError as exc:
        log.error("model_reload_failed", model=name, code=exc.code, error=exc.message)
        raise _backend_error(exc, name) from None
    state.models.release(name)  # (the backend told it too; this replica at once)
    log.info("model_reloaded", model=name, path=str(entry.config.path))
    return json_response(model_row(state.models, entry, await state.backend.models.model_cache()))


async def _forget(control: ModelOps, name: str) -> bool | None:
    try:
        return await control.forget_model(name)
    except BackendError as exc:
        log.warning("model_forget_failed", model=name, error=exc.message)
        return None


async def _finish_removal(
    state: ProxyState, control: ModelOps, entry: LiveModel
) -> bool | None:
    """Once its last request has ended: the cachemgr forgets it, the table drops it."""
    await entry.idle.wait()
    evicted = await _forget(control, entry.name)
    if state.models.unavailable(entry.name) is not None:  # gone: a later add starts afresh
        await quarantine(state, entry.name, None)  # (after the cachemgrs forgot it)
    if state.models.get(entry.name) is entry:
        state.models.drop(entry.name)
    log.info("model_removed", model=entry.name, evicted=evicted)
    return evicted


async def delete_model(request: web.Request) -> web.Response:
    """``DELETE /v1/aegaeon/models/{model}``: 200 ``removed`` when nothing of it was in
    flight, else 202 ``removing`` (it goes once its requests end)."""
    state = request.app[STATE]
    body, status = await remove_model(state, _entry(state, request.match_info["model"]))
    return json_response(body, status=status)


async def remove_model(state: ProxyState, entry: LiveModel) -> tuple[dict[str, Any], int]:
    """Stop serving ``entry`` (the admin API's removal and vLLM's
    ``/v1/unload_lora_adapter``): new requests get 404 at once, the cachemgrs forget it
    once its requests in flight have ended. The answer's body and status (200 removed,
    202 removing); 409 for a model whose LoRA adapters are still served."""
    name = entry.name
    if entry.state == "removing":
        return _removal(entry, "removing"), 202
    adapters = state.models.adapters_of(name)
    if adapters:
        raise APIError(409, f"model '{name}' has LoRA adapters served: {', '.join(adapters)} "
                       "(unload them first)", param="model", code="model_has_adapters")
    control = _control(state)
    await control.publish_served(name, None)  # every other replica: 404 as well
    if state.models.get(name) is not entry or not state.models.serving(name):
        return _removal(entry, "removing"), 202  # (raced)
    state.models.begin_remove(name)
    state.assets.remove(name)  # new requests: 404 from now on
    if entry.in_flight == 0:
        evicted = await _finish_removal(state, control, entry)
        return {**_removal(entry, "removed"), "evicted": evicted}, 200
    state.models.spawn(_finish_removal(state, control, entry))
    log.info("model_removing", model=name, in_flight=entry.in_flight)
    return _removal(entry, "removing"), 202


# ---- another replica's adds and removals (ModelOps.follow_served) --------------
def follow_served(state: ProxyState) -> Callable[[str, ModelConfig | None], None]:
    """What a replica does when another added (``model``) or removed (None) a model:
    its table and tokenizers follow; the instances and cachemgrs were told by the
    replica that changed it (it also forgets a removed model once its own requests
    have ended; this replica's requests in flight finish first here)."""
    models = state.models

    async def adopt(model: ModelConfig) -> None:
        try:
            state.assets.add(model)
            await state.assets.get(model.name)
        except AssetError as exc:  # listed, unavailable here (a reload reads it again)
            models.quarantine(model.name, str(exc))
            log.error("model_follow_failed", model=model.name, error=str(exc))
        models.finish_add(model.name)
        log.info("model_added", model=model.name, by="another replica")

    async def release(entry: LiveModel) -> None:
        await entry.idle.wait()
        if models.get(entry.name) is entry:
            models.drop(entry.name)
        log.info("model_removed", model=entry.name, by="another replica")

    def apply(name: str, model: ModelConfig | None) -> None:
        entry = models.get(name)
        if model is not None and entry is None:
            models.begin_add(model, None)
            models.spawn(adopt(model))
        elif model is None and entry is not None and entry.state == "serving":
            models.begin_remove(name)
            state.assets.remove(name)  # new requests: 404 from now on
            models.spawn(release(entry))

    return apply


def _removal(entry: LiveModel, state: str) -> dict[str, Any]:
    return {"name": entry.name, "object": "aegaeon.model", "state": state,
            "in_flight": entry.in_flight}  # fmt: skip


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/v1/aegaeon/models", list_models),
    ("POST", "/v1/aegaeon/models", add_model),
    ("GET", "/v1/aegaeon/models/{model}", get_model),
    ("PATCH", "/v1/aegaeon/models/{model}", patch_model),
    ("DELETE", "/v1/aegaeon/models/{model}", delete_model),
    ("POST", "/v1/aegaeon/models/{model}/reload", reload_model),
]
