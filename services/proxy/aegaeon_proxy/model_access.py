"""Which served model a generation or tokenizer request gets, and its text assets.

One check for every endpoint that names a model: the request's API key may use
it, it is served, its checkpoint and tokenizer can be read (else it is
quarantined), and its context length is what the deployment's KV holds per
request.
"""

from __future__ import annotations

from dataclasses import replace

from aegaeon_common.logs import get_logger
from aiohttp import web

from aegaeon_proxy.admin_models import quarantine
from aegaeon_proxy.assets import AssetError, ModelAssets
from aegaeon_proxy.auth import allowed, model_not_found
from aegaeon_proxy.model_table import unavailable_error
from aegaeon_proxy.request_ids import ACCESS
from aegaeon_proxy.state import ProxyState

log = get_logger("proxy")

__all__ = ["model_assets"]


async def model_assets(request: web.Request, state: ProxyState, model: str) -> ModelAssets:
    """``model``'s text assets, bounded by what the deployment's KV holds per request;
    404 for a model the request's key may not use or that is not served, 503
    ``model_unavailable`` for a checkpoint or tokenizer that cannot be read
    (quarantined)."""
    request[ACCESS].model = model
    if not allowed(request, model) or model not in state.assets:
        raise model_not_found(model)
    why = state.models.unavailable(model)
    if why is not None:  # its checkpoint cannot be read: refused before any tokenizing
        raise unavailable_error(model, why)
    try:
        assets = await state.assets.get(model)
    except AssetError as exc:  # its tokenizer files: unavailable, as a bad checkpoint is
        log.error("model_assets_failed", model=model, error=str(exc))
        await quarantine(state, model, str(exc))
        raise unavailable_error(model, str(exc)) from None
    # The deployment may hold fewer tokens of KV per request than the model's
    # window (device KV regions): the smaller bound is the context length.
    bound = state.backend.context_limit(model)
    if bound is not None and bound < assets.max_model_len:
        assets = replace(assets, max_model_len=bound)
    return assets
