"""The model operations (``cluster.models.ModelOps``) as a proxy replica places them
(many nodes, ``store.kind: redis``): every node's instances (the registry) and
cachemgrs (``cluster.node_caches``); and the set of models the replicas serve.

The instances answer the replica that asked (``reply_to``); an answer names only
the instance's kind and index, so the ticket it echoes says which node's it is.
An instance serves an added model once its registry record lists it (with its
latency profile over it): a replica that follows the add dispatches to it from
the same records, so an add returns only then.

A model added or removed on one replica is published in the store
(:class:`~aegaeon_common.registry.ServedModelsRecord`, one transaction per
change); every replica reads it with its registry refresh and hands each change
to its front (``follow_with``): the model table and tokenizers of a replica
follow the one that changed them, as the models' settings do. The record is
one of the :class:`~aegaeon_proxy.cluster.shared_records.SharedRecords`: every
replica writes it back if the store loses it. An instance that joins (a new
node, or a restart) is given the models added (``on_joined``).

The models whose checkpoint cannot be read are shared the same way
(:class:`~aegaeon_common.registry.UnavailableModelsRecord`, a shared record too):
the replica that learns one (a node's cachemgr reports it, an instance fails a
request with ``model_unavailable``, an admin operation is refused) publishes it,
and every replica's front refuses the model until a reload on any replica lifts
it (:class:`~aegaeon_proxy.cluster.quarantine.Quarantine`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.report import InstanceModels, ModelsResident
from aegaeon_common.registry import (
    SERVED_MODELS,
    UNAVAILABLE_MODELS,
    InstanceRecord,
    ServedModelsRecord,
    UnavailableModelsRecord,
    decode_served_models,
    decode_unavailable_models,
    encode,
)
from aegaeon_common.store import StoreError
from aegaeon_common.wire import Message

from aegaeon_proxy.backend import BackendError
from aegaeon_proxy.cluster.models import CACHE_TIMEOUT_S, ModelOps, Target
from aegaeon_proxy.cluster.node_caches import NodeCaches
from aegaeon_proxy.cluster.quarantine import Quarantine
from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.shared_records import SharedRecords

log = get_logger("cluster")

__all__ = ["ReplicaModels", "record_models", "served_changes", "with_change",
           "with_unavailable"]  # fmt: skip

Apply = Callable[[str, ModelConfig | None], None]


def record_models(record: InstanceRecord) -> frozenset[str]:
    """The models an instance's record says it serves: with their KV room and, where it
    has a latency profile, in it (dispatch estimates each request's prefill)."""
    models = frozenset(record.capacity_tokens)
    return models & frozenset(record.latency.models) if record.latency is not None else models


def with_change(raw: bytes | None, name: str, path: str | None, proxy: str,
                version: int = 0, base: str | None = None) -> ServedModelsRecord:
    """The shared record ``raw`` (None: none yet) with ``name`` added at ``path`` (a LoRA
    adapter: of ``base``) or, with None, removed."""
    record = decode_served_models(raw) if raw is not None else ServedModelsRecord(v=1)
    bases = {n: b for n, b in record.bases.items() if n != name}
    if path is not None and base is not None:
        bases[name] = base
    return ServedModelsRecord(v=1, models={**record.models, name: path}, proxy=proxy,
                              version=version, bases=bases)  # fmt: skip


class _Unchanged(Exception):  # noqa: N818 (reads as the condition)
    """A change to the shared record that changes nothing: not written."""


def with_unavailable(raw: bytes | None, name: str, why: str | None, asked_at: float,
                     proxy: str, version: int = 0) -> UnavailableModelsRecord | None:  # fmt: skip
    """The shared record ``raw`` with ``name`` unavailable (``why``, from a report asked
    for at ``asked_at``) or lifted (None, by a reload that began at ``asked_at``); None
    when that changes nothing (already there, or a report older than the last lift)."""
    record = (decode_unavailable_models(raw) if raw is not None
              else UnavailableModelsRecord(v=1))  # fmt: skip
    models, lifted = dict(record.models), dict(record.lifted)
    if why is None:
        lifted[name] = max(asked_at, lifted.get(name, 0.0))
        models.pop(name, None)
    elif name in models or asked_at < lifted.get(name, 0.0):
        return None
    else:
        models[name] = why
    return UnavailableModelsRecord(v=1, models=models, lifted=lifted, proxy=proxy,
                                   version=version)  # fmt: skip


def served_changes(record: ServedModelsRecord,
                   applied: dict[str, str | None]) -> list[tuple[str, str | None]]:  # fmt: skip
    """What ``record`` changed since ``applied`` (what a replica applied last): (name,
    path) added, (name, None) removed, in the record's order."""
    return [(n, p) for n, p in record.models.items() if n not in applied or applied[n] != p]


class ReplicaModels:
    """A replica's :class:`~aegaeon_proxy.cluster.models.Placement` (see the module).

    ``send`` sends to an instance's record; ``spawn`` runs a job of the backend."""

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
        self.ops = ModelOps(self, config)
        # instance -> (incarnation, residency version, models on its device): its answers
        self._answered: dict[str, tuple[int, int, tuple[str, ...]]] = {}
        self._apply: Apply | None = None
        self._applied: dict[str, str | None] = {}
        records.follow(SERVED_MODELS, lambda: (SERVED_MODELS,), self._followed)
        # the models whose checkpoint cannot be read, as the shared record says
        self.quarantine = Quarantine()
        records.follow(UNAVAILABLE_MODELS, lambda: (UNAVAILABLE_MODELS,),
                       self._followed_unavailable)  # fmt: skip

    # ---- Placement -------------------------------------------------------------
    def targets(self) -> list[Target]:
        out = []
        for r in self.view.live.values():
            resident, version = tuple(r.load.resident_models), r.load.residency_version
            answered = self._answered.get(r.instance_id)
            if answered is not None and answered[0] == r.incarnation and answered[1] > version:
                resident = answered[2]  # its answer is newer than its last beat
            out.append(Target(r.instance_id, r.kind, record_models(r), resident,
                              r.load.queued + r.load.running))  # fmt: skip
        return out

    def send(self, target: str, msg: Message) -> None:
        record = self.view.live.get(target)
        if record is not None:
            self._spawn(self._send(record, msg))

    async def cache_call(self, msg: Message, timeout_s: float = CACHE_TIMEOUT_S) -> list[Message]:
        return await self._caches.call_all(self.view.live.values(), msg, timeout_s)

    # ---- the instances' answers --------------------------------------------------
    def on_instance_models(self, msg: InstanceModels) -> None:
        target = self.ops.owner(msg.ticket)
        if target is not None:
            self.ops.models_answered(target, msg.ticket, frozenset(msg.capacity_tokens))

    def on_models_resident(self, msg: ModelsResident) -> None:
        target = self.ops.owner(msg.ticket)
        record = self.view.live.get(target) if target is not None else None
        if target is None or record is None:
            return
        self._answered[target] = (record.incarnation, msg.residency_version,
                                  tuple(msg.resident_models))  # fmt: skip
        self.ops.residency_answered(target, msg.ticket)

    def on_joined(self, record: InstanceRecord) -> None:
        """A (re)started instance knows only the config's models: give it those added at
        run time, and have its node's cachemgr (which may have restarted too) learn
        them and forget the removed (every replica does: each message is idempotent)."""
        ops = self.ops
        if all(n in record.capacity_tokens for n in ops.added) and not ops.removed:
            return
        address = record.cachemgr_address

        def cache_call(msg: Message) -> Coroutine[Any, Any, Message]:
            return self._caches.call(address, msg)

        self._spawn(ops.resync(record.instance_id, record.capacity_tokens, cache_call))

    # ---- the served models the replicas share ------------------------------------
    async def add(self, model: ModelConfig) -> None:
        if not self.view.prefill_candidates() and not self.config.unified:
            raise BackendError.unavailable("no prefill instance is registered")
        await self.ops.add(model)

    async def reload(self, model: ModelConfig) -> None:
        if not self.view.prefill_candidates() and not self.config.unified:
            raise BackendError.unavailable("no prefill instance is registered")
        await self.ops.reload(model)

    # ---- the unreadable models the replicas share --------------------------------
    async def publish_unavailable(self, name: str, why: str | None,
                                  asked_at: float) -> None:  # fmt: skip
        """``name`` unavailable (``why``) or available again (None), for every replica
        (this one at once); ``asked_at``: when the report was asked for, or the reload
        began. Nothing is written when it changes nothing."""

        def build(base: bytes | None, version: int) -> bytes:
            record = with_unavailable(base, name, why, asked_at, self._proxy_id, version)
            if record is None:
                raise _Unchanged
            return encode(record)

        try:
            raw = await self._records.publish(UNAVAILABLE_MODELS, build)
        except _Unchanged:
            return
        except (StoreError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError.unavailable(f"the shared store failed: {exc}") from None
        self._followed_unavailable(UNAVAILABLE_MODELS, raw)

    def _followed_unavailable(self, key: str, raw: bytes) -> None:
        """The unreadable models as a replica last published them, each change to the
        front. Raises ``msgspec.DecodeError`` for a bad record."""
        record = decode_unavailable_models(raw)
        self.quarantine.sync(record.models, record.lifted)

    def served_names(self) -> list[str]:
        """The models served now: the config's not removed, then those added."""
        names = [n for n in self.config.model_names if self._applied.get(n, n) is not None]
        return names + [n for n, p in self._applied.items()
                        if p is not None and n not in names]  # fmt: skip

    async def publish(self, name: str, model: ModelConfig | None) -> None:
        """``name`` added (``model``) or removed (None), for every replica."""
        path = str(model.path) if model is not None else None
        adapts = model.base if model is not None else None

        def build(base: bytes | None, version: int) -> bytes:
            return encode(with_change(base, name, path, self._proxy_id, version, adapts))

        try:
            raw = await self._records.publish(SERVED_MODELS, build)
        except (StoreError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError.unavailable(f"the shared store failed: {exc}") from None
        # (the record holds other replicas' changes this one had not followed yet)
        self._follow(decode_served_models(raw), mine=name)
        self._note(name, path, adapts)

    def follow_with(self, apply: Apply) -> None:
        self._apply = apply

    def _followed(self, key: str, raw: bytes) -> None:
        """The served models as another replica last changed them. Raises
        ``msgspec.DecodeError`` for a bad record."""
        self._follow(decode_served_models(raw))

    def _follow(self, record: ServedModelsRecord, mine: str | None = None) -> None:
        """Each change of ``record`` not applied here yet goes to the front and to the
        operations' bookkeeping (a restarted instance is brought up to date from it);
        ``mine``: the change this replica is making itself (its front made it)."""
        for name, path in served_changes(record, self._applied):
            if name == mine:
                continue
            model = self._note(name, path, record.bases.get(name))
            log.info("served_models_followed", model=name, added=model is not None)
            if self._apply is not None:
                self._apply(name, model)

    def _note(self, name: str, path: str | None, base: str | None = None) -> ModelConfig | None:
        self._applied[name] = path
        model = ModelConfig(name, Path(path), base=base) if path is not None else None
        if model is not None:
            self.ops.added[name] = model
            self.ops.removed.discard(name)
        else:
            self.ops.added.pop(name, None)
            if self.config.model(name) is not None:
                self.ops.removed.add(name)
        return model
