"""Models added and removed at run time (model lifecycle), and models put to sleep and
woken on the devices (``/sleep``, ``/wake_up``): one implementation for one proxy
and for replicated proxies; only where it reaches the instances and cachemgrs
(:class:`Placement`) differs.

The admin endpoints (``aegaeon_proxy.admin_models``) decide; :class:`ModelOps`
carries it out: the cachemgrs learn or forget the model (``RegisterModel``,
``ForgetModel``) and take the operator's flags (``SetModelFlags``); every live
instance is told (``AddModel``) and answers with its models
(``InstanceModels``, echoing the ticket it was sent with). An add returns once
every live instance serves the model, and fails (422) when one answered
without it (a checkpoint it cannot read).

A model sleeps when it is on no live instance's device (the instances report
the models on their device with every heartbeat and answer each
``SetModelAwake``): sleeping sends it to every live instance, waking to the
least busy prefill instance (where the model's next request starts).

The placement is ``cluster.replica_models`` (every node's instances, as the
registry lists them, and cachemgrs; one node's the same way): an instance or
cachemgr that restarts (it comes back with the config file's models) gets the
models added here again and forgets those removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import (
    ForgetModel,
    ModelForgotten,
    RegisterModel,
    ReloadModel,
    SetModelFlags,
)
from aegaeon_common.messages.prefill import AddModel, SetModelAwake
from aegaeon_common.transport import RemoteError
from aegaeon_common.wire import Message

from aegaeon_proxy.backend import BackendError

log = get_logger("cluster")

CACHE_TIMEOUT_S = 10.0
# a reload reads the whole checkpoint into the Model Cache, hashing it, before it answers
RELOAD_TIMEOUT_S = 600.0
# every live instance serves an added model within this (it reads the model's
# config between two steps; the weights come at its first switch)
ADD_TIMEOUT_S = 60.0
# an instance answers a sleep or a wake between two steps; a wake loads the weights
# (from disk when the Model Cache does not hold them)
AWAKE_TIMEOUT_S = 60.0

# cachemgr ErrorReply codes -> (HTTP status, error code) of the admin endpoints
_CACHE_ERRORS: dict[str, tuple[int, str]] = {
    "unknown_model": (404, "model_not_found"),
    "model_cache_full": (409, "model_cache_full"),
    "checkpoint_error": (422, "model_unavailable"),
}

__all__ = ["ModelOps", "Placement", "Target", "cache_error"]


def register_message(model: ModelConfig) -> RegisterModel:
    """What a cachemgr learns of a model added at run time (a LoRA adapter with its base)."""
    return RegisterModel(model.name, str(model.path), base=model.base or "")


def cache_error(exc: RemoteError) -> BackendError:
    """A cachemgr's refusal as the admin endpoints answer it; an unreadable checkpoint's
    message is the cachemgr's own (it names the file: what the model is quarantined for)."""
    status, code = _CACHE_ERRORS.get(exc.code, (503, "unavailable"))
    message = exc.reply.message if exc.code == "checkpoint_error" else f"cachemgr: {exc}"
    return BackendError(message, status=status, code=code)


@dataclass(frozen=True)
class Target:
    """A live instance as the model operations see it."""

    name: str  # how its placement names it ("prefill-0"; "node-1/prefill-0")
    kind: str  # "prefill" | "decode"
    models: frozenset[str]  # the models it serves now
    resident: tuple[str, ...]  # the models on its device, as it last reported
    work: int = 0  # requests queued and running


def _wake_rank(target: Target) -> tuple[bool, int]:
    """Prefill instances first (a model's next request starts there), least work first."""
    return target.kind != "prefill", target.work


class Placement(Protocol):
    """Where the model operations reach the instances and the cachemgrs."""

    reply_to: str  # where the instances answer ("": their proxy)

    def targets(self) -> list[Target]:
        """The live instances now."""

    def send(self, target: str, msg: Message) -> None:
        """Send ``msg`` to the instance ``target`` (in order with its other work)."""

    async def cache_call(self, msg: Message, timeout_s: float = CACHE_TIMEOUT_S) -> list[Message]:
        """``msg`` to every cachemgr (one per node); their replies. Raises
        :class:`BackendError` (after every call ended) when one failed."""


class ModelOps:
    """The model operations over a :class:`Placement`; its backend feeds it the
    instances' answers (:meth:`models_answered`, :meth:`residency_answered`)."""

    def __init__(self, place: Placement, config: Config) -> None:
        self.place = place
        self.config = config
        self.added: dict[str, ModelConfig] = {}  # models added here (not in the config)
        self.removed: set[str] = set()  # configured models removed here
        self._tickets = itertools.count(1)
        self._owners: dict[int, str] = {}  # ticket -> the target it was sent to
        self._add_sent: dict[str, int] = {}  # target -> its last AddModel's ticket
        self._add_answered: dict[str, int] = {}  # target -> the last ticket it answered
        self._answered_models: dict[str, frozenset[str]] = {}  # ... and its models then
        self._awake_sent: dict[str, int] = {}
        self._awake_answered: dict[str, int] = {}
        self._changed = asyncio.Event()

    # ---- the admin endpoints' operations ------------------------------------
    async def add(self, model: ModelConfig) -> None:
        """Register ``model`` with every cachemgr, tell every live instance, and wait
        until each serves it (a BackendError names the one that cannot)."""
        await self.place.cache_call(register_message(model))
        self.added[model.name] = model
        self.removed.discard(model.name)
        await self._take(model)

    async def reload(self, model: ModelConfig) -> None:
        """Read ``model``'s checkpoint again on every node (``ReloadModel``: its
        quarantine lifted there; a BackendError 422 ``model_unavailable`` naming what is
        wrong when it still cannot be read), then have every live instance that does
        not serve it (its config was unreadable when it started) take it."""
        await self.place.cache_call(ReloadModel(model.name, str(model.path)), RELOAD_TIMEOUT_S)
        if self.config.model(model.name) is None:  # (an add that failed: added now)
            self.added[model.name] = model
        self.removed.discard(model.name)
        await self._take(model)

    async def _take(self, model: ModelConfig) -> None:
        """Tell every live instance that does not serve ``model`` to, and wait until each
        does (a BackendError names the one that cannot)."""
        tickets = {t.name: self.send_add(t.name, model) for t in self.place.targets()
                   if model.name not in t.models}  # fmt: skip

        def waiting() -> list[str]:
            names: list[str] = []
            for target in self.place.targets():
                ticket = tickets.get(target.name)
                if ticket is None or model.name in target.models:
                    continue  # came up since (its resync gets it) or done
                if self._add_answered.get(target.name, 0) >= ticket and model.name not in \
                        self._answered_models.get(target.name, frozenset()):  # fmt: skip
                    raise BackendError(
                        f"instance {target.name} cannot serve model '{model.name}' from "
                        f"{model.path} (see its log)", status=422, code="model_unavailable",
                    )  # fmt: skip
                names.append(target.name)
            return names

        await self._until(waiting, f"take model '{model.name}'", ADD_TIMEOUT_S)

    async def forget(self, name: str) -> bool:
        """Every cachemgr forgets ``name`` (its last request ended); True: evicted now
        everywhere."""
        replies = await self.place.cache_call(ForgetModel(name))
        self.added.pop(name, None)
        if self.config.model(name) is not None:
            self.removed.add(name)
        return bool(replies) and all(isinstance(r, ModelForgotten) and r.evicted
                                     for r in replies)  # fmt: skip

    async def set_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        await self.place.cache_call(SetModelFlags(name, pinned=pinned, preload=preload))

    def sleeping(self, name: str) -> bool:
        """``name`` is on no live instance's device (as they last reported)."""
        return not any(name in t.resident for t in self.place.targets())

    async def set_awake(self, name: str, awake: bool) -> bool:
        """Sleep ``name`` on every live instance, or wake it on the least busy
        prefill instance (none, if it is on a device already); returns once they
        answered whether it sleeps now."""
        live = self.place.targets()
        if not live:
            raise BackendError.unavailable("no instance is up")
        if awake:
            if not self.sleeping(name):
                return False
            targets = [min(live, key=_wake_rank)]
        else:
            targets = live
        tickets = {}
        for target in targets:
            tickets[target.name] = ticket = self._ticket(target.name)
            self._awake_sent[target.name] = ticket
            self.place.send(target.name, SetModelAwake(name, awake, ticket,
                                                       reply_to=self.place.reply_to))

        def waiting() -> list[str]:
            live = {t.name for t in self.place.targets()}
            return [n for n, ticket in tickets.items()
                    if n in live and self._awake_answered.get(n, 0) < ticket]  # fmt: skip

        await self._until(waiting, f"{'wake' if awake else 'sleep'} model '{name}'")
        return self.sleeping(name)

    # ---- answers ---------------------------------------------------------------
    def owner(self, ticket: int) -> str | None:
        """The target a ticket was sent to (None: not one of this proxy's)."""
        return self._owners.get(ticket)

    async def resync(self, target: str, serves: Iterable[str],
                     cache_call: Callable[[Message], Awaitable[object]]) -> None:  # fmt: skip
        """A (re)started instance ``target`` knows only the config's models (``serves``):
        have its cachemgr (``cache_call``; it may have restarted too) forget the models
        removed here and learn those added, and give the instance the added ones."""
        served = frozenset(serves)
        missing = [m for n, m in self.added.items() if n not in served]
        for name in sorted(self.removed):
            with contextlib.suppress(BackendError):
                await cache_call(ForgetModel(name))
        for model in missing:
            try:
                await cache_call(register_message(model))
            except BackendError as exc:
                log.warning("model_resync_failed", model=model.name, error=exc.message)
            self.send_add(target, model)
        log.info("models_resynced", instance=target, added=[m.name for m in missing],
                 removed=sorted(self.removed))  # fmt: skip

    def send_add(self, target: str, model: ModelConfig) -> int:
        ticket = self._ticket(target)
        self._add_sent[target] = ticket
        self.place.send(target, AddModel(model.name, str(model.path), ticket,
                                         reply_to=self.place.reply_to,
                                         base=model.base or ""))  # fmt: skip
        return ticket

    def models_answered(self, target: str, ticket: int, models: frozenset[str]) -> None:
        """``target`` answered the ``AddModel`` of ``ticket``: it serves ``models``."""
        if ticket >= self._add_answered.get(target, 0):
            self._add_answered[target] = ticket
            self._answered_models[target] = models
        self._wake()

    def residency_answered(self, target: str, ticket: int) -> None:
        """``target`` answered the ``SetModelAwake`` of ``ticket`` (its residency is
        its placement's to note)."""
        self._awake_answered[target] = max(self._awake_answered.get(target, 0), ticket)
        self._wake()

    def _ticket(self, target: str) -> int:
        ticket = next(self._tickets)
        self._owners[ticket] = target
        return ticket

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def changed(self) -> None:
        """The targets changed (an instance came, went or reported): waits look again."""
        self._wake()

    async def _until(self, waiting: Callable[[], list[str]], what: str,
                     timeout_s: float = AWAKE_TIMEOUT_S) -> None:  # fmt: skip
        """Until ``waiting()`` names no instance (answers arrive), at most ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while names := waiting():
            changed = self._changed
            try:
                async with asyncio.timeout_at(deadline):
                    await changed.wait()
            except TimeoutError:
                raise BackendError.unavailable(
                    f"instances {', '.join(names)} did not {what} within {timeout_s:g} s"
                ) from None
