"""vLLM's run-time LoRA routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (admin routes, as the rest of model administration).

``load_lora_adapter`` ``{"lora_name", "lora_path"}`` serves the PEFT adapter in
``lora_path`` as the model ``lora_name`` from now on; ``lora_path`` may be left out
for an adapter of that name in the market folder. Its base is the served model
``base`` names (an Aegaeon field), else the one its ``adapter_config.json``'s
``base_model_name_or_path`` names (a served model's name, the last part of that
path in lower case, or a served model's directory), else the only served model
whose shapes it fits (or the only one served). The adapter is checked against
its base before anything changes (rank, alpha, target modules, every tensor's
shape): a bad one is a 400 naming the file and the field, and nothing is served
or written (the market is never changed here). Then it goes the way of ``POST /v1/aegaeon/models``
(:func:`~aegaeon_proxy.admin_models.serve_model`): every cachemgr and instance,
every other proxy replica.

``unload_lora_adapter`` ``{"lora_name"}`` stops serving it (new requests get 404
at once; the cachemgrs forget it once its requests in flight have ended).

Both answer vLLM's plain-text success line; errors are OpenAI error objects (400
for a bad request or adapter, 404 an adapter not served, 409 one being added or
removed).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aegaeon_common.config import ConfigError, ModelConfig, market_models
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.lora_spec import ADAPTER_CONFIG, AdapterSpec, is_adapter_dir
from aegaeon_engine.spec import ModelSpec, read_json_object
from aiohttp import web
from aiohttp.typedefs import Handler

from aegaeon_proxy.admin_models import remove_model, serve_model
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.http_io import read_json_object as read_body
from aegaeon_proxy.params import check_string
from aegaeon_proxy.state import STATE, ProxyState

__all__ = ["ROUTES", "choose_base"]

LOAD_FIELDS = ("lora_name", "lora_path", "base")
UNLOAD_FIELDS = ("lora_name", "lora_int_id")


async def _body(request: web.Request, known: tuple[str, ...]) -> dict[str, Any]:
    body = await read_body(request)
    for key in body:
        if key not in known:
            raise APIError(400, f"unknown field '{key}' (known: {', '.join(known)})", param=key,
                           code="unknown_parameter")  # fmt: skip
    return body


def _optional(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    return None if value is None else check_string(key, value)


def choose_base(path: Path, bases: dict[str, ModelConfig], asked: str | None) -> ModelConfig:
    """The served model the adapter in ``path`` is of (see the module docstring); a 400
    naming what is wrong otherwise. Blocking (reads JSON files)."""
    if asked is not None:
        if asked not in bases:
            raise APIError(400, f"base '{asked}' is not a served model (served: "
                           f"{', '.join(bases) or 'none'})", param="base",
                           code="model_not_found")  # fmt: skip
        return bases[asked]
    try:
        config = read_json_object(path / ADAPTER_CONFIG) or {}
    except CheckpointError:
        config = {}  # the check against the base names the broken file
    hint = config.get("base_model_name_or_path")
    if isinstance(hint, str) and hint:
        tail = hint.rstrip("/").rsplit("/", 1)[-1].lower()
        named = [m for n, m in bases.items()
                 if n in (hint, tail) or _same_dir(m.path, hint)]  # fmt: skip
        if len(named) == 1:
            return named[0]
    fitting = [m for m in bases.values() if _fits(path, m)]
    if len(fitting) == 1:
        return fitting[0]
    if len(bases) == 1:  # the one it can be: its check says what is wrong
        return next(iter(bases.values()))
    why = (f"its base_model_name_or_path {hint!r} names no served model" if hint
           else "it names no base model")
    raise APIError(400, f"adapter '{path}': {why} and {len(fitting)} served models fit its "
                   f"shapes; give 'base' (one of: {', '.join(bases) or 'none'})",
                   param="base", code="base_not_found")  # fmt: skip


def _same_dir(path: Path, hint: str) -> bool:
    try:
        return Path(hint).resolve() == Path(path).resolve()
    except OSError:
        return False


def _fits(path: Path, base: ModelConfig) -> bool:
    try:
        AdapterSpec.from_dir(path, ModelSpec.from_dir(base.path))
    except CheckpointError:
        return False
    return True


def _check(name: str, path: Path, base: ModelConfig) -> None:
    """The adapter against its base; a 400 naming the file and the field otherwise."""
    try:
        AdapterSpec.from_dir(path, ModelSpec.from_dir(base.path), name)
    except CheckpointError as exc:
        raise APIError(400, f"LoRA adapter '{name}' cannot be served: {exc}",
                       param="lora_path", code="invalid_lora_adapter") from None


async def _market_path(state: ProxyState, name: str) -> Path:
    """Where the market folder keeps adapter ``name`` (``lora_path`` left out)."""
    market = state.config.market_dir
    offered: list[ModelConfig] = []
    if market is not None:
        try:
            offered = await asyncio.to_thread(market_models, market)
        except ConfigError:
            offered = []
    model = next((m for m in offered if m.name == name and m.base is not None), None)
    if model is None:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided (no adapter "
                       f"'{name}' in the market folder)", param="lora_path",
                       code="invalid_value")  # fmt: skip
    return Path(model.path)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"[, "base"]}``."""
    state = request.app[STATE]
    body = await _body(request, LOAD_FIELDS)
    name = check_string("lora_name", body.get("lora_name"))
    raw_path = _optional(body, "lora_path")
    asked = _optional(body, "base")
    if state.models.get(name) is not None:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                       param="lora_name", code="model_exists")  # fmt: skip
    path = Path(raw_path).resolve() if raw_path is not None else await _market_path(state, name)
    if not await asyncio.to_thread(is_adapter_dir, path):
        raise APIError(400, f"LoRA adapter '{name}' cannot be served: {path / ADAPTER_CONFIG}: "
                       "missing file (expected a PEFT adapter directory)", param="lora_path",
                       code="invalid_lora_adapter")  # fmt: skip
    base = await asyncio.to_thread(choose_base, path, state.models.bases(), asked)
    await asyncio.to_thread(_check, name, path, base)
    if state.models.get(name) is not None:  # (added meanwhile)
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                       param="lora_name", code="model_exists")  # fmt: skip
    await serve_model(state, ModelConfig(name, path, base=base.name), {})
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""
    state = request.app[STATE]
    body = await _body(request, UNLOAD_FIELDS)
    name = check_string("lora_name", body.get("lora_name"))
    entry = state.models.get(name)
    if entry is None or entry.state == "adding":
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found")  # fmt: skip
    if entry.config.base is None:
        raise APIError(400, f"'{name}' is a model, not a LoRA adapter (remove it with DELETE "
                       f"/v1/aegaeon/models/{name})", param="lora_name",
                       code="not_an_adapter")  # fmt: skip
    await remove_model(state, entry)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/load_lora_adapter", load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", unload_lora_adapter),
]
