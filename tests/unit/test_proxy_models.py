"""Model lifecycle and sleep on a proxy replica (``cluster.models``), no
processes: every node's cachemgr and instances told, answers matched to their node
by ticket, an add done once the registry records list the model, sleep read from the
records, the served set and the unreadable models one replica publishes followed by
another, a reload on every node."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.messages.cache import (
    ForgetModel,
    ModelForgotten,
    ModelRegistered,
    ModelReloaded,
    RegisterModel,
    ReloadModel,
)
from aegaeon_common.messages.prefill import AddModel, SetModelAwake
from aegaeon_common.messages.report import InstanceModels, ModelsResident
from aegaeon_common.registry import (
    UNAVAILABLE_MODELS,
    InstanceLoadInfo,
    InstanceRecord,
    ServedModelsRecord,
    UnavailableModelsRecord,
    served_changes,
    with_change,
    with_unavailable,
)
from aegaeon_common.store import MemoryStore
from aegaeon_common.wire import Message
from aegaeon_proxy.backend import BackendError
from aegaeon_proxy.cluster.models import SharedModels
from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.shared_records import SharedRecords
from fake_worker import latency_profile
from proxy_support import instance_record, put_records

OLD, NEW = "old-model", "new-model"
NODES = ("node-0", "node-1")
REPLY_TO = "tcp://127.0.0.1:9"


def _record(node: str, kind: str, models: list[str], *, resident: list[str] | None = None,
            version: int = 0, work: int = 0) -> InstanceRecord:  # fmt: skip
    return instance_record(
        node, kind, address=f"tcp://{node}:1", capacity_tokens=dict.fromkeys(models, 100),
        latency=latency_profile(models), cachemgr_address=f"tcp://{node}:2",
        load=InstanceLoadInfo(resident_models=resident or [], residency_version=version,
                              queued=work),
    )  # fmt: skip


class Caches:
    """Every node's cachemgr (test double of ``NodeCaches``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Message]] = []

    async def call(self, address: str, msg: Message) -> Message:
        self.calls.append((address, msg))
        return ModelRegistered(msg.name) if isinstance(msg, RegisterModel) else msg

    async def call_all(self, records: object, msg: Message,
                       timeout_s: float = 10.0) -> list[Message]:  # fmt: skip
        nodes = sorted({r.cachemgr_address for r in records})  # type: ignore[attr-defined]
        self.calls += [(n, msg) for n in nodes]
        if isinstance(msg, RegisterModel):
            return [ModelRegistered(msg.name) for _ in nodes]
        if isinstance(msg, ReloadModel):
            return [ModelReloaded(msg.name, True) for _ in nodes]
        assert isinstance(msg, ForgetModel)
        return [ModelForgotten(msg.name, True) for _ in nodes]


class Replica:
    def __init__(self, store: MemoryStore, name: str = "a") -> None:
        self.store = store
        self.view = RegistryView(store, hybrid_prefill=False)
        self.caches = Caches()
        self.sent: list[tuple[str, Message]] = []
        self.applied: list[tuple[str, ModelConfig | None]] = []
        config = Config(models=(ModelConfig(OLD, Path("/m/old")),))

        async def send(record: InstanceRecord, msg: Message) -> None:
            self.sent.append((record.instance_id, msg))

        self.jobs: list[asyncio.Future[None]] = []

        def spawn(work: Coroutine[Any, Any, None]) -> None:
            self.jobs.append(asyncio.ensure_future(work))

        self.records = SharedRecords(store)
        caches: Any = self.caches
        self.models = SharedModels(config, self.view, caches, self.records, send, spawn,
                                    REPLY_TO, f"proxy-{name}")  # fmt: skip
        self.models.follow_served(lambda n, m: self.applied.append((n, m)))

    async def put(self, *records: InstanceRecord) -> None:
        await put_records(self.store, *records)
        await self.view.refresh()
        self.models.changed()

    def answer(self, instance: str, models: list[str]) -> None:
        ticket = [m.ticket for n, m in self.sent if n == instance and isinstance(m, AddModel)][-1]
        self.models.on_instance_models(
            InstanceModels("prefill", 0, 0, dict.fromkeys(models, 100), ticket=ticket)
        )


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def _every(models: list[str], **kw: object) -> list[InstanceRecord]:
    return [_record(n, k, models, **kw) for n in NODES for k in ("prefill", "decode")]  # type: ignore[arg-type]


async def test_an_add_reaches_every_node_and_waits_for_the_records() -> None:
    replica = Replica(MemoryStore())
    await replica.put(*_every([OLD]))
    task = asyncio.ensure_future(replica.models.add_model(ModelConfig(NEW, Path("/m/new"))))
    await _settle()
    assert replica.caches.calls == [(f"tcp://{n}:2", RegisterModel(NEW, "/m/new")) for n in NODES]
    adds = [(n, m) for n, m in replica.sent if isinstance(m, AddModel)]
    assert sorted(n for n, _ in adds) == sorted(r.instance_id for r in _every([OLD]))
    assert all(m.reply_to == REPLY_TO and m.name == NEW for _, m in adds)
    assert len({m.ticket for _, m in adds}) == 4  # each answer says whose it is
    for instance, _ in adds:  # (answers name only kind and index: prefill-0 twice)
        replica.answer(instance, [OLD, NEW])
    await _settle()
    assert not task.done()  # the records do not list it yet: another replica could not
    await replica.put(*_every([OLD, NEW])[:3])
    await _settle()
    assert not task.done()
    await replica.put(*_every([OLD, NEW]))
    await asyncio.wait_for(task, 5)
    assert NEW in replica.view.latency().specs  # type: ignore[union-attr]  # re-read
    assert await replica.models.forget_model(NEW) is True
    assert [m for _, m in replica.caches.calls[-2:]] == [ForgetModel(NEW)] * 2


async def test_an_instance_that_cannot_read_it_fails_the_add() -> None:
    replica = Replica(MemoryStore())
    await replica.put(*_every([OLD]))
    task = asyncio.ensure_future(replica.models.add_model(ModelConfig(NEW, Path("/m/new"))))
    await _settle()
    replica.answer("node-1/decode-0", [OLD])  # answered without it (checkpoint error)
    with pytest.raises(BackendError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.status == 422 and "node-1/decode-0" in info.value.message


async def test_sleep_is_read_from_every_nodes_records_and_answers() -> None:
    replica = Replica(MemoryStore())
    await replica.put(*_every([OLD], resident=[OLD], version=1))
    ops = replica.models
    assert not ops.model_sleeping(OLD)
    task = asyncio.ensure_future(ops.set_model_awake(OLD, False))
    await _settle()
    sleeps = [(n, m) for n, m in replica.sent if isinstance(m, SetModelAwake)]
    assert len(sleeps) == 4 and all(not m.awake and m.reply_to == REPLY_TO for _, m in sleeps)
    for _, msg in sleeps:  # each answers: off its device (a newer count than its beat)
        replica.models.on_models_resident(ModelsResident("prefill", 0, msg.ticket, [], 2))
    assert await asyncio.wait_for(task, 5) is True
    # another replica reads the same from the records once the instances beat
    other = Replica(replica.store, "b")
    await other.put(*_every([OLD], version=2))
    assert other.models.model_sleeping(OLD)
    # a wake goes to the least busy prefill instance of any node
    await other.put(_record("node-0", "prefill", [OLD], version=2, work=3))
    task = asyncio.ensure_future(other.models.set_model_awake(OLD, True))
    await _settle()
    wakes = [(n, m) for n, m in other.sent if isinstance(m, SetModelAwake)]
    assert [n for n, _ in wakes] == ["node-1/prefill-0"]
    other.models.on_models_resident(ModelsResident("prefill", 0, wakes[0][1].ticket, [OLD], 3))
    assert await asyncio.wait_for(task, 5) is False


async def test_a_replica_follows_what_another_published() -> None:
    store = MemoryStore()
    a, b = Replica(store, "a"), Replica(store, "b")
    await a.models.publish_served(NEW, ModelConfig(NEW, Path("/m/new")))
    await b.records.refresh()
    await b.records.refresh()  # (nothing new: nothing applied twice)
    assert b.applied == [(NEW, ModelConfig(NEW, Path("/m/new")))]
    assert b.models.served_names() == [OLD, NEW] and NEW in b.models.added
    await a.models.publish_served(NEW, None)
    await a.models.publish_served(OLD, None)
    await b.records.refresh()
    assert b.applied[1:] == [(NEW, None), (OLD, None)]
    assert b.models.served_names() == [] and b.models.removed == {OLD}
    # a third replica that starts now takes the whole record
    c = Replica(store, "c")
    await c.records.refresh()
    assert c.applied == [(NEW, None), (OLD, None)]


async def test_a_replica_that_changes_the_set_follows_what_it_had_not_read_yet() -> None:
    store = MemoryStore()
    a, b = Replica(store, "a"), Replica(store, "b")
    await a.models.publish_served(NEW, ModelConfig(NEW, Path("/m/new")))
    await b.models.publish_served(OLD, None)  # b had not read a's add: its change holds it
    assert b.applied == [(NEW, ModelConfig(NEW, Path("/m/new")))]  # (its own: its front's)
    assert b.models.served_names() == [NEW] and b.models.removed == {OLD}
    await b.records.refresh()
    assert len(b.applied) == 1


def test_the_shared_record_and_its_changes() -> None:
    first = with_change(None, NEW, "/m/new", "p")
    assert first == ServedModelsRecord(v=1, models={NEW: "/m/new"}, proxy="p")
    second = with_change(msgspec.msgpack.encode(first), OLD, None, "q")
    assert second.models == {NEW: "/m/new", OLD: None} and second.proxy == "q"
    assert served_changes(second, {NEW: "/m/new"}) == [(OLD, None)]
    assert served_changes(second, {NEW: None, OLD: None}) == [(NEW, "/m/new")]


async def test_an_instance_that_joins_is_given_the_models_added() -> None:
    replica = Replica(MemoryStore())
    await replica.models.publish_served(NEW, ModelConfig(NEW, Path("/m/new")))
    await replica.records.refresh()
    joined = [_record("node-1", "prefill", [OLD, NEW]), _record("node-1", "decode", [OLD])]
    await replica.put(*joined)
    for record in joined:  # the decode instance restarted without it; the prefill has it
        replica.models.on_joined(record)
    await _settle()
    assert replica.caches.calls == [("tcp://node-1:2", RegisterModel(NEW, "/m/new"))]
    assert [(n, m.name) for n, m in replica.sent if isinstance(m, AddModel)] == [
        ("node-1/decode-0", NEW)
    ]


async def test_the_unreadable_models_are_shared_until_a_reload_lifts_them() -> None:
    store = MemoryStore()
    a, b = Replica(store, "a"), Replica(store, "b")
    seen: list[tuple[str, str | None]] = []
    b.models.follow_unavailable(lambda n, w: seen.append((n, w)))
    await a.models.publish_unavailable(NEW, "/m/new/model.safetensors: missing file", 100.0)
    assert a.models.unavailable == {NEW: "/m/new/model.safetensors: missing file"}
    await b.records.refresh()
    await b.records.refresh()  # (nothing new: nothing applied twice)
    assert seen == [(NEW, "/m/new/model.safetensors: missing file")]
    # the first error stands; a reload (on b) lifts it for every replica
    await b.models.publish_unavailable(NEW, "another error", 101.0)
    await b.models.publish_unavailable(NEW, None, 200.0)
    assert seen[-1] == (NEW, None) and not b.models.unavailable
    await a.records.refresh()
    assert not a.models.unavailable
    # a cachemgr's report asked for before the reload is old news; one after is not
    await a.models.publish_unavailable(NEW, "stale", 150.0)
    await b.records.refresh()
    assert not b.models.unavailable
    await a.models.publish_unavailable(NEW, "broken again", 250.0)
    await b.records.refresh()
    assert b.models.unavailable == {NEW: "broken again"}
    # a store that lost it gets it back from the replicas that know it
    await store.delete(UNAVAILABLE_MODELS)
    await a.records.refresh()
    c = Replica(store, "c")
    await c.records.refresh()
    assert c.models.unavailable == {NEW: "broken again"}


def test_the_unavailable_record_and_its_changes() -> None:
    first = with_unavailable(None, NEW, "why", 10.0, "p", version=3)
    assert first == UnavailableModelsRecord(v=1, models={NEW: "why"}, proxy="p", version=3)
    raw = msgspec.msgpack.encode(first)
    assert with_unavailable(raw, NEW, "other", 11.0, "q") is None  # known: no write
    lifted = with_unavailable(raw, NEW, None, 20.0, "q")
    assert lifted is not None and lifted.models == {} and lifted.lifted == {NEW: 20.0}
    assert with_unavailable(msgspec.msgpack.encode(lifted), NEW, "x", 19.0, "p") is None


async def test_a_reload_reads_it_again_on_every_node_and_gives_it_to_who_lacks_it() -> None:
    replica = Replica(MemoryStore())
    await replica.put(*_every([OLD]))
    # prefill-0 of node-0 could not read its config at start: only it gets AddModel
    await replica.put(_record("node-0", "prefill", []))
    task = asyncio.ensure_future(replica.models.reload_model(ModelConfig(OLD, Path("/m/old"))))
    await _settle()
    assert replica.caches.calls == [(f"tcp://{n}:2", ReloadModel(OLD, "/m/old")) for n in NODES]
    adds = [(n, m.name) for n, m in replica.sent if isinstance(m, AddModel)]
    assert adds == [("node-0/prefill-0", OLD)]
    replica.answer("node-0/prefill-0", [OLD])
    await replica.put(_record("node-0", "prefill", [OLD]))
    await asyncio.wait_for(task, 5)
