"""Ollama's per-request ``keep_alive``, on the lifecycle admin's mechanisms.

A request may carry ``keep_alive``: a number of seconds or a Go duration
string (``"30s"``, ``"5m"``, ``"1h30m"``); ``0`` unloads the model after the
request, a negative value keeps it loaded until told otherwise. As in Ollama,
the model's last request decides, counted from when it ends:

* ``0``: the model goes to sleep (off every device; ``/sleep``) once no request
  of it is in flight, and a hold from an earlier ``keep_alive`` ends;
* negative: the model is *held* in the host Model Cache (the cachemgr's pin)
  until a later request says otherwise;
* ``d`` > 0: held for ``d`` after this request; then the hold ends and the
  model is one of the market's again (the Model Cache's LRU, token-level
  switching on the devices).

A hold is a Model Cache pin, not a device: on a device a model stays until
another model needs the room (that is how Aegaeon shares a device), and
switching it back in from host memory is a copy, not a load from disk. The
operator's own pin (``PATCH /v1/aegaeon/models/{model}``) stands beside it: a
model is pinned while either wants it.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Coroutine
from typing import Any

from aegaeon_common.logs import get_logger

from aegaeon_proxy.backend import NOT_SUPPORTED, BackendError, ModelOps
from aegaeon_proxy.errors import invalid
from aegaeon_proxy.model_table import ModelSettingsTable

log = get_logger("proxy")

__all__ = ["FOREVER", "KeepAlive", "parse_keep_alive"]

FOREVER = math.inf
MAX_FINITE_S = 1e8  # about three years: longer is forever
_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
            "h": 3600.0}  # fmt: skip
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(rf"([+-]?)((?:{_PART.pattern})+)")


def _seconds(value: float) -> float:
    if value < 0 or value > MAX_FINITE_S:
        return FOREVER
    return float(value)


def parse_keep_alive(param: str, value: Any) -> float:
    """``keep_alive`` as seconds (0: unload after; :data:`FOREVER`: keep); a 400
    naming ``param`` when it is neither a number nor a Go duration string."""
    if isinstance(value, bool):
        raise invalid(param, f"'{param}' must be a number of seconds or a duration like '5m'")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise invalid(param, f"'{param}' must be a finite number of seconds")
        return _seconds(value)
    if isinstance(value, str) and len(value) <= 64:
        text = value.strip()
        if text in ("0", "+0", "-0"):
            return 0.0
        match = _DURATION.fullmatch(text)
        if match is not None:
            total = sum(float(n) * _UNITS_S[u] for n, u in _PART.findall(match.group(2)))
            return _seconds(-total if match.group(1) == "-" else total)
    shown = repr(value)[:40]
    raise invalid(param, f"'{param}' must be a number of seconds or a duration such as "
                  f"'30s', '5m', '1h30m' (negative: keep loaded), got {shown}")  # fmt: skip


class KeepAlive:
    """Each model's keep-alive, last request wins (see the module docstring)."""

    def __init__(self, backend: ModelOps, models: ModelSettingsTable) -> None:
        """What it acts through: the backend's model controls, the live model table
        (the operator's pin, requests in flight)."""
        self._backend = backend
        self._models = models
        self._held: dict[str, float] = {}  # model -> when its hold ends (loop time; inf)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def held(self, model: str) -> bool:
        """A keep-alive holds ``model`` in the Model Cache now."""
        return model in self._held

    def after(self, model: str, keep_alive_s: float) -> None:
        """A request of ``model`` with ``keep_alive`` (seconds) ended."""
        loop = asyncio.get_running_loop()
        timer = self._timers.pop(model, None)
        if timer is not None:
            timer.cancel()
        was_held = model in self._held
        if keep_alive_s <= 0:
            self._held.pop(model, None)
            if was_held:
                self._spawn(self._apply_pin(model))
            entry = self._models.get(model)
            if entry is None or entry.in_flight == 0:  # its other requests keep it
                self._spawn(self._sleep(model))
            return
        self._held[model] = loop.time() + keep_alive_s
        if not was_held:
            self._spawn(self._apply_pin(model))
        if keep_alive_s != FOREVER:
            self._timers[model] = loop.call_later(keep_alive_s, self._expire, model)

    def _expire(self, model: str) -> None:
        self._timers.pop(model, None)
        if self._held.pop(model, None) is not None:
            log.info("keep_alive_expired", model=model)
            self._spawn(self._apply_pin(model))

    async def _apply_pin(self, model: str) -> None:
        """The cachemgr's pin of ``model``: the operator's or a keep-alive's."""
        if not self._models.serving(model):
            return
        pinned = self._models.settings(model).pin or self.held(model)
        try:
            await self._backend.set_model_flags(model, pinned=pinned, preload=False)
        except BackendError as exc:  # the request was served; the hold is best effort
            if exc.code != NOT_SUPPORTED:
                log.warning("keep_alive_pin_failed", model=model, pinned=pinned,
                            error=exc.message)  # fmt: skip

    async def _sleep(self, model: str) -> None:
        try:
            asleep = await self._backend.set_model_awake(model, False)
        except BackendError as exc:
            if exc.code != NOT_SUPPORTED:
                log.warning("keep_alive_sleep_failed", model=model, error=exc.message)
            return
        log.info("keep_alive_unloaded", model=model, asleep=asleep)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Cancel the timers and the controls still running (the app stops)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
