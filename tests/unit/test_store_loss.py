"""A store that restarts empty, or stops answering a while, loses nothing for good: its
writers put their records back, an instance merges its queues back, the replicas keep
the instances the store lost until it has settled, and the records nobody re-derives
(settings, served models) are written back by the replicas that keep them, the
newest winning. No processes: a MemoryStore whose contents the test wipes."""

from __future__ import annotations

from pathlib import Path

import msgspec
from aegaeon_common.config import Config, ModelConfig, ModelSettings
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.registry import (
    INSTANCES,
    SERVED_MODELS,
    ModelSettingsRecord,
    decode_model_settings,
    decode_served_models,
    encode,
    instance_key,
    prefill_queue_key,
    with_change,
)
from aegaeon_common.store import MemoryStore
from aegaeon_proxy.cluster.registry import RegistryView, StoreHealth
from aegaeon_proxy.cluster.shared_records import SharedRecords
from aegaeon_runtime.registrar import Registrar
from aegaeon_runtime.shared_queues import QueueSnapshots
from aegaeon_sched import PrefillQueue, Request
from aegaeon_sched.shared import prefill_queue_of, queued_request_ids
from proxy_support import instance_record, put_records

KEY = "modelsettings:m"


def _wipe(store: MemoryStore) -> None:
    """The store restarted without persistence."""
    store._values.clear()
    store._sets.clear()


class Replica:
    """One replica's shared records: the settings of model ``m`` and the served set."""

    def __init__(self, store: MemoryStore, name: str) -> None:
        self.name = name
        self.records = SharedRecords(store, clock=lambda: 0.0)  # versions count 1, 2, ...
        self.applied: list[tuple[str, bytes]] = []
        self.records.follow("modelsettings:", lambda: [KEY], self._apply)
        self.records.follow(SERVED_MODELS, lambda: [SERVED_MODELS], self._apply)

    def _apply(self, key: str, raw: bytes) -> None:
        self.applied.append((key, raw))

    async def patch(self, cap: int) -> None:
        def build(base: bytes | None, version: int) -> bytes:
            settings = ModelSettings(max_concurrency=cap)
            return encode(ModelSettingsRecord(v=1, model="m", settings=settings,
                                              proxy=self.name, version=version))  # fmt: skip

        await self.records.publish(KEY, build)

    async def serve(self, name: str, path: str | None) -> None:
        def build(base: bytes | None, version: int) -> bytes:
            return encode(with_change(base, name, path, self.name, version))

        await self.records.publish(SERVED_MODELS, build)


async def _cap(store: MemoryStore) -> int | None:
    raw = await store.get(KEY)
    return None if raw is None else decode_model_settings(raw).settings.max_concurrency


async def test_the_replicas_write_back_what_the_store_lost_and_agree_on_the_newest() -> None:
    store = MemoryStore()
    a, b = Replica(store, "a"), Replica(store, "b")
    await a.patch(3)
    await b.records.refresh()
    assert [k for k, _ in b.applied] == [KEY]
    _wipe(store)
    await a.records.refresh()  # a writes it back; b finds it there, newest already
    await b.records.refresh()
    assert await _cap(store) == 3 and len(b.applied) == 1
    # b lags (a changed it since b's last read); the store is lost; b writes back first
    await a.patch(5)
    _wipe(store)
    await b.records.refresh()
    assert await _cap(store) == 3  # b's: the only one it knows
    await a.records.refresh()  # a's is newer: written over b's
    await b.records.refresh()  # b follows it
    assert await _cap(store) == 5 and decode_model_settings(b.applied[-1][1]).version == 2
    assert a.records.num_written_back == 2 and b.records.num_written_back == 1
    # a replica that restarts with the store knows nothing: it follows, resurrects nothing
    _wipe(store)
    c = Replica(store, "c")
    await c.records.refresh()
    assert await store.get(KEY) is None and not c.applied
    await a.records.refresh()
    await c.records.refresh()
    assert await _cap(store) == 5 and [k for k, _ in c.applied] == [KEY]


async def test_a_change_after_a_loss_builds_on_the_record_kept_not_an_empty_one() -> None:
    store = MemoryStore()
    a, b = Replica(store, "a"), Replica(store, "b")
    await a.serve("new", "/m/new")
    await a.serve("old", None)
    await b.records.refresh()
    _wipe(store)
    await b.serve("x", "/m/x")  # before anyone wrote the record back
    raw = await store.get(SERVED_MODELS)
    assert raw is not None
    assert decode_served_models(raw).models == {"new": "/m/new", "old": None, "x": "/m/x"}
    await a.records.refresh()  # b's change is newer than what a keeps: a follows it
    assert a.records.kept[SERVED_MODELS] == raw and a.records.num_written_back == 0


async def test_a_replica_takes_no_missing_record_for_a_death_until_the_store_settles() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    health = StoreHealth(settle_s=3.5, clock=lambda: now[0])
    view = RegistryView(store, hybrid_prefill=True, health=health)
    a, b = instance_record("a", "prefill"), instance_record("b", "prefill")
    await put_records(store, a, b, ttl_s=3.0)
    assert len((await view.refresh())[0]) == 2
    _wipe(store)  # restarted empty: the replica saw a new epoch (or an error)
    health.troubled()
    joined, left = await view.refresh()
    assert not joined and not left and sorted(view.live) == ["a/prefill-0", "b/prefill-0"]
    now[0] = 0.5
    await put_records(store, a, ttl_s=3.0)  # a beats again; b died meanwhile
    joined, left = await view.refresh()
    assert not joined and not left and len(view.prefill_candidates()) == 2
    now[0] = 3.6  # settled: b's record is still missing, b is gone
    await put_records(store, a, ttl_s=3.0)
    joined, left = await view.refresh()
    assert [r.instance_id for r in left] == ["b/prefill-0"] and list(view.live) == ["a/prefill-0"]


def _queue(*rids: str) -> bytes:
    queue = PrefillQueue(max_group_size=8)
    for rid in rids:
        queue.add(Request(rid, "m", 0.0, 10, 4), 1)
    return msgspec.msgpack.encode(queue)


async def test_an_instance_merges_its_queue_back_when_the_store_lost_it(tmp_path: Path) -> None:
    store = MemoryStore()
    config = Config(models=(ModelConfig("m", tmp_path / "m"),), run_dir=tmp_path)
    snapshots = QueueSnapshots()
    hello = InstanceHello("prefill", 0, 1, 1, 1, 8, {"m": 100}, incarnation=42)
    registrar = Registrar(config, store, hello, "http://127.0.0.1:1", snapshots)
    stats = InstanceStats("prefill", 0, None, 0, 0)
    key = prefill_queue_key(registrar.instance_id, 42)

    async def queued() -> set[str]:
        return queued_request_ids(prefill_queue_of(await store.get(key)))

    await registrar.beat(stats)
    await store.put(key, _queue("r1", "r2"))  # the replicas' dispatch
    held = ["r1", "r2"]  # what the compute thread holds
    _wipe(store)
    await store.put(key, _queue("r3"))  # booked on the empty store since
    await registrar.beat(stats)  # listed again, a new epoch: a snapshot is asked for
    assert await store.get(instance_key(registrar.instance_id)) is not None
    assert await store.set_members(INSTANCES) == {registrar.instance_id}
    snapshots.offer(lambda: (_queue(*held), None))  # the compute thread, between steps
    await registrar.beat(stats)
    assert await queued() == {"r1", "r2", "r3"}
    # r1 finished here meanwhile (its replica's removal went to the empty store): the
    # instance takes out what it put back once it no longer holds it
    held = ["r2"]
    await registrar.beat(stats)  # asks for a snapshot
    snapshots.offer(lambda: (_queue(*held), None))
    await registrar.beat(stats)
    assert await queued() == {"r2", "r3"}
    assert registrar.queues.put_back == {key: {"r2"}} and registrar.queues.num_rebuilds == 1
    # only its record expired (the store or the process was stopped a while), a replica
    # tidied its id away: listed again, same epoch, nothing rebuilt (the replicas ended
    # or re-dispatched its work)
    await store.delete(instance_key(registrar.instance_id))
    await store.set_remove(INSTANCES, registrar.instance_id)
    await registrar.beat(stats)
    snapshots.offer(lambda: (_queue("r9"), None))
    await registrar.beat(stats)
    assert registrar.queues.num_rebuilds == 1 and "r9" not in await queued()
    assert await store.set_members(INSTANCES) == {registrar.instance_id}


def test_records_carry_a_version_that_older_writers_leave_at_zero() -> None:
    old = msgspec.msgpack.encode({"v": 1, "model": "m", "settings": {}, "proxy": "p"})
    assert decode_model_settings(old).version == 0
