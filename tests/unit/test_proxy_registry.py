"""A replica's view of the registry: expiry, restarts, and which node Algorithm 1 tries first."""

from __future__ import annotations

from aegaeon_common.registry import (
    INSTANCES,
    InstanceLoadInfo,
    InstanceRecord,
    encode,
    instance_key,
)
from aegaeon_common.store import MemoryStore
from aegaeon_proxy.cluster.registry import RegistryView


def _record(node: str, kind: str, incarnation: int = 1, busy: int = 0) -> InstanceRecord:
    return InstanceRecord(
        v=1, instance_id=f"{node}/{kind}-0", node=node, kind=kind, index=0,
        address="tcp://127.0.0.1:1", incarnation=incarnation, pid=1,
        capacity_tokens={"m": 100}, max_batch_size=8,
        load=InstanceLoadInfo(open_sequences=busy),
    )  # fmt: skip


async def _put(store: MemoryStore, record: InstanceRecord, ttl_s: float = 3.0) -> None:
    await store.put(instance_key(record.instance_id), encode(record), ttl_s)
    await store.set_add(INSTANCES, record.instance_id)


async def test_expired_and_restarted_instances_leave_and_the_idle_node_comes_first() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    view = RegistryView(store, hybrid_prefill=True)
    for rec in (_record("a", "prefill", busy=5), _record("a", "decode", busy=3),
                _record("b", "prefill"), _record("b", "decode", busy=1)):  # fmt: skip
        await _put(store, rec)
    joined, left = await view.refresh()
    assert len(joined) == 4 and not left
    # ties in Algorithm 1 go to the first instance: the least busy node's
    assert [r.instance_id for r in view.prefill_candidates()] == ["b/prefill-0", "a/prefill-0"]
    assert [r.kind for r in view.decode_candidates("a")] == ["decode", "prefill"]
    # node a stops beating; b restarts its prefill instance (a new incarnation)
    now[0] = 2.0
    for rec in (_record("b", "prefill", incarnation=2), _record("b", "decode", busy=1)):
        await _put(store, rec)
    now[0] = 3.5
    joined, left = await view.refresh()
    assert {r.instance_id for r in left} == {"a/prefill-0", "a/decode-0", "b/prefill-0"}
    assert [r.instance_id for r in joined] == ["b/prefill-0"]
    assert not view.alive("b/prefill-0", 1) and view.alive("b/prefill-0", 2)
    assert await store.set_members(INSTANCES) == {"b/prefill-0", "b/decode-0"}
