"""The model operations (add, remove, reload, flags, sleep and wake) over every node's
instances and cachemgrs, and what the proxies share of the models.

The admin endpoints (``aegaeon_proxy.admin_models``) decide; :class:`SharedModels`
carries it out. An instance answers the proxy that asked (``reply_to``), echoing
the ticket it was sent with: an answer names only the instance's kind and index,
so the ticket says which node's it is. An instance serves an added model once its
registry record lists it: a proxy that follows the add dispatches to it from the
same records, so an add returns only then.

The models served, their settings and the unreadable ones (quarantine: polled from
the cachemgrs every :data:`WATCH_S` and when an instance joins) are records in the
store, kept by every proxy as
:class:`~aegaeon_proxy.cluster.shared_records.SharedRecords` (written back if the
store loses them); each change goes to every proxy's front (``follow_*``): an
unreadable model is 503 ``model_unavailable`` everywhere until a reload on any
proxy lifts it. An instance or cachemgr that (re)starts knows only the config
file's models: it is given those added here again and forgets those removed
(``on_joined``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aegaeon_common.config import Config, ModelConfig, ModelSettings
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import (
    ForgetModel,
    ModelForgotten,
    RegisterModel,
    ReloadModel,
    SetModelFlags,
)
from aegaeon_common.messages.prefill import AddModel, SetModelAwake
from aegaeon_common.messages.report import InstanceModels, ModelsResident
from aegaeon_common.registry import (
    SERVED_MODELS,
    UNAVAILABLE_MODELS,
    InstanceRecord,
    ModelSettingsRecord,
    ServedModelsRecord,
    decode_model_settings,
    decode_served_models,
    decode_unavailable_models,
    encode,
    model_settings_key,
    served_changes,
    with_change,
    with_unavailable,
)
from aegaeon_common.wire import Message

from aegaeon_proxy.backend import BackendError, ModelOps
from aegaeon_proxy.cluster.node_caches import CACHE_TIMEOUT_S, NodeCaches
from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.shared_records import SharedRecords

log = get_logger("cluster")

# a reload reads the whole checkpoint into the Model Cache, hashing it, before it answers
RELOAD_TIMEOUT_S = 600.0
# every live instance serves an added model within this (it reads the model's
# config between two steps; the weights come at its first switch)
ADD_TIMEOUT_S = 60.0
# an instance answers a sleep or a wake between two steps; a wake loads the weights
# (from disk when the Model Cache does not hold them)
AWAKE_TIMEOUT_S = 60.0
WATCH_S = 1.0  # how often the cachemgrs' unreadable models are looked at
# how long a cachemgr may take to answer that (one that died is not waited for)
POLL_TIMEOUT_S = 2.0

__all__ = ["WATCH_S", "SharedModels", "record_models"]

Apply = Callable[[str, ModelConfig | None], None]


def register_message(model: ModelConfig) -> RegisterModel:
    """What a cachemgr learns of a model added at run time (a LoRA adapter with its base)."""
    return RegisterModel(model.name, str(model.path), base=model.base or "")


def record_models(record: InstanceRecord) -> frozenset[str]:
    """The models an instance's record says it serves: with their KV room and, where it
    has a latency profile, in it (dispatch estimates each request's prefill)."""
    models = frozenset(record.capacity_tokens)
    return models & frozenset(record.latency.models) if record.latency is not None else models


class SharedModels(ModelOps):
    """See the module. ``send`` sends to an instance's record; ``spawn`` runs a job of
    the backend."""

    changes_models = True

    def __init__(
        self,
        config: Config,
        view: RegistryView,
        caches: NodeCaches,
        records: SharedRecords,
        send: Callable[[InstanceRecord, Message], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        reply_to: str,
        proxy_id: str,
    ) -> None:
        self.config = config
        self.view = view
        self._caches = caches
        self._records = records
        self._send = send
        self._spawn = spawn
        self.reply_to = reply_to
        self._proxy_id = proxy_id
        self.added: dict[str, ModelConfig] = {}  # models added here (not in the config)
        self.removed: set[str] = set()  # configured models removed here
        self._tickets = itertools.count(1)
        self._owners: dict[int, str] = {}  # ticket -> the instance it was sent to, unanswered
        self._answered: dict[int, frozenset[str]] = {}  # ticket -> the models its answer named
        # instance -> (incarnation, residency version, models on its device): its answers
        self._answered_resident: dict[str, tuple[int, int, tuple[str, ...]]] = {}
        self._changed = asyncio.Event()
        self._apply: Apply = lambda name, model: None  # (the front's, once it follows)
        self._applied: dict[str, str | None] = {}
        # (the served models as another replica last changed them)
        records.follow(SERVED_MODELS, lambda: (SERVED_MODELS,),
                       lambda _key, raw: self._follow(decode_served_models(raw)))  # fmt: skip
        # the models whose checkpoint cannot be read (name -> why), as the shared record
        # says (the front follows them: ModelOps._on_unavailable)
        self.unavailable: dict[str, str] = {}
        records.follow(UNAVAILABLE_MODELS, lambda: (UNAVAILABLE_MODELS,),
                       self._followed_unavailable)  # fmt: skip
        # (after the served set: a model added elsewhere is served here before its settings)
        self._apply_settings: Callable[[str, ModelSettings], None] = lambda name, s: None
        records.follow("modelsettings:", lambda: map(model_settings_key, self.served_names()),
                       self._settings_followed)  # fmt: skip

    def _resident(self, record: InstanceRecord) -> tuple[str, ...]:
        """The models on the instance's device, as it last reported."""
        answered = self._answered_resident.get(record.instance_id)
        if answered is not None and answered[0] == record.incarnation and \
                answered[1] > record.load.residency_version:  # fmt: skip
            return answered[2]  # its answer is newer than its last beat
        return tuple(record.load.resident_models)

    async def _cache_call(self, msg: Message, timeout_s: float = CACHE_TIMEOUT_S) -> list[Message]:
        return await self._caches.call_all(self.view.live.values(), msg, timeout_s)

    # ---- the admin endpoints' operations ------------------------------------
    async def add_model(self, model: ModelConfig) -> None:
        self._need_prefill()
        await self._cache_call(register_message(model))
        self._mark(model.name, model)
        await self._take(model)

    async def reload_model(self, model: ModelConfig) -> None:
        """Lifted everywhere as of the reload's start; still unreadable: quarantined
        again for what is wrong now (an instance whose config was unreadable when it
        started takes the model now)."""
        self._need_prefill()
        began = time.time()
        try:
            await self._cache_call(ReloadModel(model.name, str(model.path)), RELOAD_TIMEOUT_S)
            if self.config.model(model.name) is None:  # (an add that failed: added now)
                self.added[model.name] = model
            self.removed.discard(model.name)
            await self._take(model)
        except BackendError as exc:
            if exc.code == "model_unavailable":
                await self.publish_unavailable(model.name, None, began)
                await self.publish_unavailable(model.name, exc.message, time.time())
            raise
        await self.publish_unavailable(model.name, None, began)

    def _need_prefill(self) -> None:
        if not self.view.prefill_candidates() and not self.config.unified:
            raise BackendError.unavailable("no prefill instance is registered")

    async def _take(self, model: ModelConfig) -> None:
        """Tell every live instance that does not serve ``model`` to, and wait until each
        does (a BackendError names the one that cannot)."""
        tickets = {i: self._send_add(r, model) for i, r in self.view.live.items()
                   if model.name not in record_models(r)}  # fmt: skip

        def waiting() -> list[str]:
            names: list[str] = []
            for name, record in self.view.live.items():
                ticket = tickets.get(name)
                if ticket is None or model.name in record_models(record):
                    continue  # came up since (its resync gets it) or done
                models = self._answered.get(ticket)
                if models is not None and model.name not in models:
                    raise BackendError(
                        f"instance {name} cannot serve model '{model.name}' from "
                        f"{model.path} (see its log)", status=422, code="model_unavailable",
                    )  # fmt: skip
                names.append(name)
            return names

        await self._until(waiting, f"take model '{model.name}'", ADD_TIMEOUT_S)

    async def forget_model(self, name: str) -> bool:
        replies = await self._cache_call(ForgetModel(name))
        self._mark(name, None)
        return bool(replies) and all(isinstance(r, ModelForgotten) and r.evicted
                                     for r in replies)  # fmt: skip

    async def set_model_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        await self._cache_call(SetModelFlags(name, pinned=pinned, preload=preload))

    async def model_cache(self) -> dict[str, Any] | None:
        return await self._caches.model_cache(self.view.live.values())

    def model_sleeping(self, name: str) -> bool:
        return not any(name in self._resident(r) for r in self.view.live.values())

    async def set_model_awake(self, name: str, awake: bool) -> bool:
        """A wake goes to the least busy prefill instance (none, if the model is on a
        device already)."""
        live = list(self.view.live.values())
        if not live:
            raise BackendError.unavailable("no instance is up")
        if awake and not self.model_sleeping(name):
            return False
        if awake:  # prefill instances first (a model's next request starts there), least work
            live = [min(live, key=lambda r: (r.kind != "prefill", r.load.queued + r.load.running))]
        tickets = {r.instance_id: self._ask(r, lambda t: SetModelAwake(
            name, awake, t, reply_to=self.reply_to)) for r in live}  # fmt: skip

        def waiting() -> list[str]:
            return [n for n, ticket in tickets.items()
                    if n in self.view.live and ticket not in self._answered]  # fmt: skip

        await self._until(waiting, f"{'wake' if awake else 'sleep'} model '{name}'")
        return self.model_sleeping(name)

    async def check_unavailable(self, asked_at: float) -> None:
        """Publish the models some node's cachemgr cannot read (asked at ``asked_at``).
        Raises ``BackendError`` when none answered, ``StoreError``."""
        # (a node whose cachemgr died keeps its records until their TTL: not waited for)
        cache = await self._caches.model_cache(self.view.live.values(), POLL_TIMEOUT_S)
        if cache is None:
            raise BackendError.unavailable("no node's cachemgr answered")
        for name, why in dict(cache.get("unavailable", {})).items():
            if name not in self.unavailable:
                await self.publish_unavailable(name, why, asked_at)

    # ---- the instances' answers ------------------------------------------------
    def _send_add(self, record: InstanceRecord, model: ModelConfig) -> int:
        return self._ask(record, lambda t: AddModel(model.name, str(model.path), t,
                                                    reply_to=self.reply_to,
                                                    base=model.base or ""))  # fmt: skip

    def _ask(self, record: InstanceRecord, make: Callable[[int], Message]) -> int:
        """``make(ticket)`` to the instance; the ticket its answer echoes."""
        ticket = next(self._tickets)
        self._owners[ticket] = record.instance_id
        self._spawn(self._send(record, make(ticket)))
        return ticket

    def on_instance_models(self, msg: InstanceModels) -> None:
        """An answer to an ``AddModel``: the instance serves these models."""
        if self._owners.pop(msg.ticket, None) is not None:
            self._answered[msg.ticket] = frozenset(msg.capacity_tokens)
        self.changed()

    def on_models_resident(self, msg: ModelsResident) -> None:
        """An answer to a ``SetModelAwake``: the models on the instance's device now."""
        target = self._owners.pop(msg.ticket, None)
        record = self.view.live.get(target) if target is not None else None
        if target is None or record is None:
            return
        self._answered_resident[target] = (record.incarnation, msg.residency_version,
                                           tuple(msg.resident_models))  # fmt: skip
        self._answered[msg.ticket] = frozenset(msg.resident_models)
        self.changed()

    def changed(self) -> None:
        """The instances changed (one came, went or answered): waits look again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _until(self, waiting: Callable[[], list[str]], what: str,
                     timeout_s: float = AWAKE_TIMEOUT_S) -> None:  # fmt: skip
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

    def on_joined(self, record: InstanceRecord) -> None:
        """A (re)started instance knows only the config's models: give it those added at
        run time, and have its node's cachemgr (which may have restarted too) learn
        them and forget the removed (every replica does: each message is idempotent)."""
        if all(n in record.capacity_tokens for n in self.added) and not self.removed:
            return
        self._spawn(self._resync(record))

    async def _resync(self, record: InstanceRecord) -> None:
        address = record.cachemgr_address
        missing = [m for n, m in self.added.items() if n not in record.capacity_tokens]
        for name in sorted(self.removed):
            with contextlib.suppress(BackendError):
                await self._caches.call(address, ForgetModel(name))
        for model in missing:
            try:
                await self._caches.call(address, register_message(model))
            except BackendError as exc:
                log.warning("model_resync_failed", model=model.name, error=exc.message)
            if self.view.alive(record.instance_id, record.incarnation):  # (still that process)
                self._send_add(record, model)
        log.info("models_resynced", instance=record.instance_id,
                 added=[m.name for m in missing], removed=sorted(self.removed))  # fmt: skip

    # ---- the settings the replicas share ---------------------------------------------
    async def publish_model_settings(self, name: str, settings: ModelSettings) -> None:
        def build(base: bytes | None, version: int) -> bytes:
            return encode(ModelSettingsRecord(v=1, model=name, settings=settings,
                                              proxy=self._proxy_id, version=version))  # fmt: skip

        await self._records.publish(model_settings_key(name), build)

    def follow_model_settings(self, apply: Callable[[str, ModelSettings], None]) -> None:
        self._apply_settings = apply

    def _settings_followed(self, key: str, raw: bytes) -> None:
        record = decode_model_settings(raw)
        self._apply_settings(record.model, record.settings)

    # ---- the unreadable models the replicas share --------------------------------
    def follow_unavailable(self, apply: Callable[[str, str | None], None]) -> None:
        self._on_unavailable = apply
        for name, why in self.unavailable.items():
            apply(name, why)

    def failed(self, name: str, why: str) -> None:
        """An instance could not read ``name`` (``why``): unavailable here at once, then
        everywhere (the first error stands until a reload)."""
        if name not in self.unavailable:
            self._tell(name, why)
            self._spawn(self.publish_unavailable(name, why, time.time()))

    async def quarantine_model(self, name: str, why: str | None) -> None:
        await self.publish_unavailable(name, why, time.time())

    async def publish_unavailable(self, name: str, why: str | None,
                                  asked_at: float) -> None:  # fmt: skip
        """``name`` unavailable (``why``) or available again (None), for every replica
        (this one at once); ``asked_at``: when the report was asked for, or the reload
        began. Nothing is written when it changes nothing."""

        def build(base: bytes | None, version: int) -> bytes | None:
            record = with_unavailable(base, name, why, asked_at, self._proxy_id, version)
            return encode(record) if record is not None else None

        raw = await self._records.publish(UNAVAILABLE_MODELS, build)
        if raw is not None:
            self._followed_unavailable(UNAVAILABLE_MODELS, raw)

    def _followed_unavailable(self, key: str, raw: bytes) -> None:
        """The unreadable models as a replica last published them, each change to the
        front. Raises ``msgspec.DecodeError`` for a bad record."""
        models = decode_unavailable_models(raw).models
        for name in [n for n in self.unavailable if n not in models]:
            self._tell(name, None)
        for name, why in models.items():
            if self.unavailable.get(name) != why:
                self._tell(name, why)

    def _tell(self, name: str, why: str | None) -> None:
        if why is None:
            self.unavailable.pop(name, None)
        else:
            self.unavailable[name] = why
            log.error("model_unavailable", model=name, error=why)
        if self._on_unavailable is not None:
            self._on_unavailable(name, why)

    def served_names(self) -> list[str]:
        """The models served now: the config's not removed, then those added."""
        names = [n for n in self.config.model_names if self._applied.get(n, n) is not None]
        return names + [n for n, p in self._applied.items()
                        if p is not None and n not in names]  # fmt: skip

    async def publish_served(self, name: str, model: ModelConfig | None) -> None:
        path = str(model.path) if model is not None else None
        adapts = model.base if model is not None else None

        def build(base: bytes | None, version: int) -> bytes:
            return encode(with_change(base, name, path, self._proxy_id, version, adapts))

        raw = await self._records.publish(SERVED_MODELS, build)
        assert raw is not None  # (a change is always written)
        # (the record holds other replicas' changes this one had not followed yet)
        self._follow(decode_served_models(raw), mine=name)
        self._note(name, path, adapts)

    def follow_served(self, apply: Apply) -> None:
        self._apply = apply

    def _follow(self, record: ServedModelsRecord, mine: str | None = None) -> None:
        """Each change of ``record`` not applied here yet goes to the front and to the
        operations' bookkeeping (a restarted instance is brought up to date from it);
        ``mine``: the change this replica is making itself (its front made it)."""
        for name, path in served_changes(record, self._applied):
            if name == mine:
                continue
            model = self._note(name, path, record.bases.get(name))
            log.info("served_models_followed", model=name, added=model is not None)
            self._apply(name, model)

    def _note(self, name: str, path: str | None, base: str | None = None) -> ModelConfig | None:
        self._applied[name] = path
        model = ModelConfig(name, Path(path), base=base) if path is not None else None
        self._mark(name, model)
        return model

    def _mark(self, name: str, model: ModelConfig | None) -> None:
        if model is not None:
            self.added[name] = model
            self.removed.discard(name)
        else:
            self.added.pop(name, None)
            if self.config.model(name) is not None:
                self.removed.add(name)
