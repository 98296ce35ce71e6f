"""A replica's view of the registry: expiry, restarts, and which node Algorithm 1 tries first."""

from __future__ import annotations

from aegaeon_common.registry import (
    INSTANCES,
    InstanceLoadInfo,
    InstanceRecord,
)
from aegaeon_common.store import MemoryStore
from aegaeon_proxy.cluster.registry import RegistryView
from proxy_support import instance_record, put_records


def _record(node: str, kind: str, incarnation: int = 1, busy: int = 0) -> InstanceRecord:
    return instance_record(node, kind, incarnation=incarnation,
                           load=InstanceLoadInfo(open_sequences=busy))  # fmt: skip


async def test_expired_and_restarted_instances_leave_and_the_idle_node_comes_first() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    view = RegistryView(store, hybrid_prefill=True)
    for rec in (_record("a", "prefill", busy=5), _record("a", "decode", busy=3),
                _record("b", "prefill"), _record("b", "decode", busy=1)):  # fmt: skip
        await put_records(store, rec, ttl_s=3.0)
    joined, left = await view.refresh()
    assert len(joined) == 4 and not left
    # ties in Algorithm 1 go to the first instance: the least busy node's
    assert [r.instance_id for r in view.prefill_candidates()] == ["b/prefill-0", "a/prefill-0"]
    assert [r.kind for r in view.decode_candidates("a")] == ["decode", "prefill"]
    # node a stops beating; b restarts its prefill instance (a new incarnation)
    now[0] = 2.0
    for rec in (_record("b", "prefill", incarnation=2), _record("b", "decode", busy=1)):
        await put_records(store, rec, ttl_s=3.0)
    now[0] = 3.5
    joined, left = await view.refresh()
    assert {r.instance_id for r in left} == {"a/prefill-0", "a/decode-0", "b/prefill-0"}
    assert [r.instance_id for r in joined] == ["b/prefill-0"]
    assert not view.alive("b/prefill-0", 1) and view.alive("b/prefill-0", 2)
    assert await store.set_members(INSTANCES) == {"b/prefill-0", "b/decode-0"}
