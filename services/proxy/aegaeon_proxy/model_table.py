"""The models the proxy serves now and their live settings (model lifecycle).

One :class:`ModelSettingsTable` per proxy (``ProxyState.models``) is the one
place that says which models are served and with which ``model_settings``:
the config's at start, changed at run time by the admin endpoints
(``aegaeon_proxy.admin_models``: ``PATCH``, ``POST``, ``DELETE
/v1/aegaeon/models``). Everything that reads a model's settings per request
(admission: ``max_concurrency``; the SLO class checks: ``slo_classes``,
``min_ttft_s``, ``min_tbt_s``) reads :meth:`ModelSettingsTable.settings`, so a
``PATCH`` applies to the next request.

It also counts each model's requests in flight (:meth:`enter` when a
generation is submitted, :meth:`leave` when it ends): ``max_concurrency`` is
checked there, and a removed model leaves the cachemgr once its count is 0.

A served model whose checkpoint cannot be read is *unavailable*
(:meth:`ModelSettingsTable.quarantine`, as the backend learns it): still listed,
with why, and its requests answered 503 ``model_unavailable`` until it is
reloaded (:meth:`ModelSettingsTable.release`). Pure bookkeeping on the event
loop: no I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aegaeon_common.config import ModelConfig, ModelSettings

from aegaeon_proxy.auth import model_not_found
from aegaeon_proxy.errors import APIError

ModelState = Literal["adding", "serving", "removing"]

__all__ = ["LiveModel", "ModelSettingsTable", "ModelState", "concurrency_refusal",
           "unavailable_error"]  # fmt: skip


@dataclass
class LiveModel:
    """One model the proxy knows: its checkpoint, live settings, state, open requests."""

    config: ModelConfig
    settings: ModelSettings
    state: ModelState = "serving"
    runtime: bool = False  # added by POST /v1/aegaeon/models (not in the config file)
    in_flight: int = 0
    # set when it is being removed and its last request has ended
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.config.name


def concurrency_refusal(model: str, settings: ModelSettings, in_flight: int) -> str | None:
    """Why one more request of ``model`` is refused (``max_concurrency`` reached), or None."""
    bound = settings.max_concurrency
    if bound is not None and in_flight >= bound:
        return f"model '{model}' has {in_flight} requests in flight (max_concurrency {bound})"
    return None


def unavailable_error(model: str, why: str) -> APIError:
    """The answer to a request of ``model``, whose checkpoint cannot be read (``why``
    names the file): 503, as for any service that is down until an operator acts (no
    Retry-After: it does not come back by itself)."""
    return APIError(
        503, f"model '{model}' is unavailable: its checkpoint cannot be read: {why} (an "
        f"operator fixes the file, then POST /v1/aegaeon/models/{model}/reload)",
        param="model", code="model_unavailable",
    )  # fmt: skip


class ModelSettingsTable:
    """Served models in config order (runtime additions after them), by name."""

    def __init__(self, models: Iterable[ModelConfig], settings: dict[str, ModelSettings]) -> None:
        self._defaults = settings.get("*") or ModelSettings()
        self._models: dict[str, LiveModel] = {
            m.name: LiveModel(m, settings.get(m.name) or self._defaults) for m in models
        }
        # removals waiting for their model's last request, another replica's adds
        # (:meth:`spawn`: held so they are not collected)
        self.background: set[asyncio.Task[Any]] = set()
        # models whose checkpoint cannot be read -> why (kept for names not listed
        # yet: another replica's add may come after its quarantine)
        self._unavailable: dict[str, str] = {}

    # ---- reading -------------------------------------------------------------
    def __iter__(self) -> Iterator[LiveModel]:
        return iter(list(self._models.values()))

    @property
    def defaults(self) -> ModelSettings:
        """``model_settings["*"]``: what a model without its own entry gets."""
        return self._defaults

    def get(self, name: str) -> LiveModel | None:
        return self._models.get(name)

    def serving(self, name: str) -> bool:
        """True when ``name`` takes new requests."""
        entry = self._models.get(name)
        return entry is not None and entry.state == "serving"

    def names(self) -> list[str]:
        """The models that take new requests (``GET /v1/models``)."""
        return [m.name for m in self._models.values() if m.state == "serving"]

    def adapters(self) -> list[str]:
        """The LoRA adapters among :meth:`names`."""
        return [m.name for m in self._models.values()
                if m.state == "serving" and m.config.base is not None]

    def bases(self) -> dict[str, ModelConfig]:
        """The models among :meth:`names` that are no adapter (adapters may be added over them)."""
        return {m.name: m.config for m in self._models.values()
                if m.state == "serving" and m.config.base is None}  # fmt: skip

    def adapters_of(self, base: str) -> list[str]:
        """The LoRA adapters of ``base`` this proxy knows (serving or on their way)."""
        return [m.name for m in self._models.values() if m.config.base == base]

    def settings(self, name: str) -> ModelSettings:
        """The live ``model_settings`` of ``name`` (the ``"*"`` defaults when unknown)."""
        entry = self._models.get(name)
        return entry.settings if entry is not None else self._defaults

    def model_config(self, name: str) -> ModelConfig | None:
        entry = self._models.get(name)
        return entry.config if entry is not None else None

    def unavailable(self, name: str) -> str | None:
        """Why ``name``'s checkpoint cannot be read, or None (it can, or is not known)."""
        return self._unavailable.get(name)

    def unavailable_models(self) -> dict[str, str]:
        """The models listed now whose checkpoint cannot be read, and why."""
        return {n: w for n, w in self._unavailable.items() if n in self._models}

    def state_of(self, entry: LiveModel) -> str:
        """``entry``'s state as the API shows it: ``unavailable`` for a served model whose
        checkpoint cannot be read, else its lifecycle state."""
        if entry.state == "serving" and entry.name in self._unavailable:
            return "unavailable"
        return entry.state

    # ---- checkpoints that cannot be read -----------------------------------------
    def quarantine(self, name: str, why: str) -> bool:
        """``name`` cannot be read (``why``): its requests get 503 from now on; True if
        this is news."""
        news = self._unavailable.get(name) != why
        self._unavailable[name] = why
        return news

    def release(self, name: str) -> bool:
        """``name`` was read again: served as before; True if it was unavailable."""
        return self._unavailable.pop(name, None) is not None

    def follow_unavailable(self, name: str, why: str | None) -> None:
        """``name`` found unreadable (``why``) or read again (None), here or on another
        replica (``ModelOps.follow_unavailable``)."""
        if why is None:
            self.release(name)
        else:
            self.quarantine(name, why)

    # ---- requests ------------------------------------------------------------
    def enter(self, name: str) -> None:
        """One more request of ``name`` starts: 404 if it is not served (removed
        meanwhile), 429 at its ``max_concurrency``."""
        entry = self._models.get(name)
        if entry is None or entry.state != "serving":
            raise model_not_found(name)
        unreadable = self._unavailable.get(name)
        if unreadable is not None:
            raise unavailable_error(name, unreadable)
        why = concurrency_refusal(name, entry.settings, entry.in_flight)
        if why is not None:
            raise APIError(429, f"{why}; retry later", code="overloaded", retry_after_s=1.0)
        entry.in_flight += 1

    def leave(self, name: str) -> None:
        """A request of ``name`` ended (it counted in :meth:`enter`)."""
        entry = self._models.get(name)
        if entry is None:
            return
        entry.in_flight = max(0, entry.in_flight - 1)
        if entry.in_flight == 0 and entry.state == "removing":
            entry.idle.set()

    # ---- changes (the admin endpoints) ---------------------------------------
    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` (a change that waits) in the background."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def update(self, name: str, settings: ModelSettings) -> None:
        """``name``'s settings now (a no-op for a model it does not list: another replica's
        PATCH of a model removed here meanwhile)."""
        entry = self._models.get(name)
        if entry is not None:
            entry.settings = settings

    def begin_add(self, model: ModelConfig, settings: ModelSettings | None) -> LiveModel:
        """Reserve ``model.name`` while it is being added (not served yet)."""
        if model.name in self._models:
            raise KeyError(model.name)
        entry = LiveModel(model, settings or self._defaults, state="adding", runtime=True)
        self._models[model.name] = entry
        return entry

    def finish_add(self, name: str) -> None:
        self._models[name].state = "serving"

    def drop(self, name: str) -> None:
        """Forget ``name`` (an add that failed, or a removal that is complete)."""
        self._models.pop(name, None)
        self._unavailable.pop(name, None)

    def begin_remove(self, name: str) -> LiveModel:
        """No new request of ``name`` from now on; :attr:`LiveModel.idle` is set once
        the requests it has in flight have ended."""
        entry = self._models[name]
        entry.state = "removing"
        if entry.in_flight == 0:
            entry.idle.set()
        return entry

    def replaced(self, name: str, changes: dict[str, object]) -> ModelSettings:
        """``name``'s settings with ``changes`` (ModelSettings field names) applied."""
        return msgspec.structs.replace(self._models[name].settings, **changes)
