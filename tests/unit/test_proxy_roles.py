"""The proxy's role switching (no processes): the driver, the instances' records and
arrivals in, role changes out (``AegaeonPolicy.set_role`` carries one out in the
simulator, the roles record in dispatch); velocity metrics. Across proxy replicas
(one in-memory store): the replica holding the lease decides from the shared state
(another replica's arrivals included) and writes the record, the other follows it
and dispatches by it, the lease passes on when the decider stops, and the roles
hold still while an instance drains. The pure parts: the backlog and decode demand
of shared states, the placement's ``reserved`` instances."""

from __future__ import annotations

import time
from typing import cast

from aegaeon_common.config import Config, RolesConfig
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.registry import (
    PROXIES,
    InstanceLoadInfo,
    InstanceRecord,
    ProxyRecord,
    encode,
    proxy_key,
)
from aegaeon_common.store import MemoryStore
from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.roles import LEASE_S, SharedRoles
from aegaeon_sched import AegaeonPolicy, EnqueuePrefill, Request, RoleChange, RoleLoad
from aegaeon_sched.decode import DecodeWorkList
from aegaeon_sched.prefill_queue import PrefillQueue
from aegaeon_sched.shared import (
    decode_demands,
    place_decode,
    prefill_backlog,
)
from fake_worker import latency_model, latency_profile
from proxy_support import instance_record, put_records

ROLES = RolesConfig(enabled=True, high_util=0.5, low_util=0.2, up_hold_s=0.0, down_hold_s=1.0,
                    min_dwell_s=0.5)  # fmt: skip


BASE = {"prefill-0": "prefill", "decode-0": "decode"}


def _record(name: str, prefill_tokens: float, prefill_s: float, capacity: dict[str, int]
            | None = None, latency: LatencyProfile | None = None) -> InstanceRecord:  # fmt: skip
    kind, _, index = name.rpartition("-")
    load = InstanceLoadInfo(prefill_s=prefill_s, prefill_tokens=int(prefill_tokens))
    return InstanceRecord(v=1, instance_id=name, node="local", kind=kind, index=int(index),
                          address="", incarnation=1, pid=1, capacity_tokens=capacity or {},
                          max_batch_size=8, latency=latency, load=load)  # fmt: skip


def _meters(prefill_tokens: float, prefill_s: float) -> list[InstanceRecord]:
    return [_record(n, prefill_tokens, prefill_s) for n in BASE]


def _switcher(config: Config) -> SharedRoles:
    """A proxy's roles over the configured ``BASE`` (no store: it only decides here)."""
    roles = SharedRoles(config, cast(MemoryStore, None), RegistryView(cast(MemoryStore, None),
                        hybrid_prefill=True), "p")  # fmt: skip
    roles.controller.track(BASE)
    return roles


def _observe(switcher: SharedRoles, now_s: float, load: RoleLoad, meters: list[InstanceRecord],
             alive: bool) -> list[RoleChange]:  # fmt: skip
    return switcher.decide(now_s, meters, load.backlog_tokens, load.decode_demand, load.latency,
                           alive)  # fmt: skip


def _policy() -> AegaeonPolicy:
    return AegaeonPolicy(["prefill-0", "decode-0"], ["decode-0", "prefill-0"],
                         latency_model(["a", "b"]), standby=["decode-0"],
                         default_ttft_s=10.0)  # fmt: skip


def _load(policy: AegaeonPolicy) -> RoleLoad:
    load = policy.role_load()
    assert load is not None  # (roles move under the aegaeon policy)
    return load


def test_a_burst_moves_the_decode_instance_and_its_end_moves_it_back() -> None:
    switcher = _switcher(Config(models=(), roles=ROLES))
    policy = _policy()
    meters = _meters(1000.0, 1.0)  # measured: 1000 prompt tokens/s while prefilling
    assert _observe(switcher, 0.0, _load(policy), meters, alive=True) == []  # nothing arrives
    switcher.arrived(0.1, 4000)  # 2000 tokens/s over the 2 s window > 0.5 x 1000
    (up,) = _observe(switcher, 0.2, _load(policy), meters, alive=True)
    assert (up.instance, up.role) == ("decode-0", "prefill")
    assert switcher.roles["decode-0"] == "prefill" and switcher.switches["prefill"] == 1
    # the caller applies it: decode-0 takes prefill work from now on
    policy.set_role(up.instance, up.role, 0.2)
    policy.on_arrival(Request("r0", "a", 0.2, 500, 8), 0.2)  # r0's group on prefill-0
    late = policy.on_arrival(Request("r1", "b", 0.2, 500, 8), 0.2)  # a new group: least loaded
    assert [a.instance for a in late if isinstance(a, EnqueuePrefill)] == ["decode-0"]
    # the burst is over (window passed, queues empty): back after down_hold
    policy.on_request_cancelled("r0", 3.0)
    policy.on_request_cancelled("r1", 3.0)
    assert _observe(switcher, 3.0, _load(policy), meters, alive=True) == []
    (back,) = _observe(switcher, 4.1, _load(policy), meters, alive=True)
    assert (back.instance, back.role) == ("decode-0", "decode")
    assert switcher.snapshot(4.1)["roles"] == {"prefill-0": "prefill", "decode-0": "decode"}
    assert [c["role"] for c in switcher.changes] == ["prefill", "decode"]


def test_roles_hold_still_while_an_instance_is_down() -> None:
    meters = _meters(1000.0, 1.0)
    policy = _policy()
    switcher = _switcher(Config(models=(), roles=ROLES))
    switcher.arrived(0.0, 100_000)
    assert _observe(switcher, 0.1, _load(policy), meters, alive=False) == []
    assert switcher.roles == BASE  # (with roles off nothing decides: the replicas' test)


def test_velocity_is_measured_once_an_instance_has_prefilled_else_estimated() -> None:
    switcher = _switcher(Config(models=()))
    lat = latency_model(["a"])
    prefill = _record("prefill-0", 3000.0, 1.5)
    decode = _record("decode-0", 0.0, 0.0, {"a": 4096})
    assert switcher.prefill_velocity(prefill, lat) == 2000.0
    assert switcher.prefill_velocity(decode, lat) > 0  # from a profile (here the fallback)


def test_an_instance_in_the_prefill_role_takes_prefill_work_and_decodes_last() -> None:
    """Dispatch by the roles: decode-0 moved to the prefill role is a prefill candidate;
    with hybrid prefill every instance of the node decodes, decode instances first."""
    lat = latency_profile(["a"])
    view = RegistryView(cast(MemoryStore, None), hybrid_prefill=True)
    view.live = {n: _record(n, 0.0, 0.0, {"a": 4096}, lat) for n in BASE}
    assert [r.instance_id for r in view.prefill_candidates()] == ["prefill-0"]
    view.roles = {"decode-0": "prefill"}
    assert [r.instance_id for r in view.prefill_candidates()] == ["decode-0", "prefill-0"]
    assert [r.instance_id for r in view.decode_candidates("local")] == ["decode-0", "prefill-0"]


CONFIG = Config(models=(), roles=ROLES)
PROFILE = latency_profile(["m"])


def _shared_record(kind: str, draining: bool = False) -> InstanceRecord:
    # measured: 1000 prompt tokens/s while prefilling
    return instance_record("a", kind, capacity_tokens={"m": 4096}, latency=PROFILE,
                           draining=draining,
                           load=InstanceLoadInfo(prefill_s=1.0, prefill_tokens=1000))  # fmt: skip


async def _replica(store: MemoryStore, name: str) -> SharedRoles:
    view = RegistryView(store, hybrid_prefill=True)
    await view.refresh()
    return SharedRoles(CONFIG, store, view, name)


async def _publish(store: MemoryStore, replica: SharedRoles, now_s: float) -> None:
    """``replica``'s heartbeat (its arrival velocity), as the backend's beat writes it."""
    record = ProxyRecord(v=1, proxy_id=replica.proxy_id, report_address="tcp://x:1", pid=1,
                         arrival_tokens_per_s=replica.arrivals.rate(now_s))  # fmt: skip
    await store.put(proxy_key(replica.proxy_id), encode(record), 60.0)
    await store.set_add(PROXIES, replica.proxy_id)


def _prefill_ids(replica: SharedRoles) -> list[str]:
    return sorted(r.instance_id for r in replica.view.prefill_candidates())


async def test_one_replica_decides_on_every_replicas_arrivals_and_the_others_follow() -> None:
    clock = [0.0]
    store = MemoryStore(clock=lambda: clock[0])
    await put_records(store, _shared_record("prefill"), _shared_record("decode"), ttl_s=60.0)
    a, b = await _replica(store, "a"), await _replica(store, "b")
    await a.refresh()
    await b.refresh()
    assert a.deciding and not b.deciding and b.record.proxy == "a"
    assert _prefill_ids(a) == _prefill_ids(b) == ["a/prefill-0"]
    # a burst reaches replica b only: 4000 tokens over its 2 s window > 0.5 x 1000 tok/s
    now = time.monotonic()
    b.arrived(now, 4000)
    await _publish(store, b, now)
    await a.refresh()
    assert a.view.roles["a/decode-0"] == "prefill" and a.switches["prefill"] == 1
    await b.refresh()
    assert _prefill_ids(b) == ["a/decode-0", "a/prefill-0"]
    snap = b.snapshot(now)
    assert snap["decider"] == "a" and snap["deciding"] is False
    changes = snap["changes"]
    assert isinstance(changes, list) and changes[-1]["instance"] == "a/decode-0"
    # replica a dies: its lease lapses and b decides, from the roles a decided
    clock[0] += LEASE_S + 0.1
    await b.refresh()
    assert b.deciding and b.view.roles["a/decode-0"] == "prefill"
    # b stops cleanly: it gives the lease up, and a decides at its next read
    await b.leave()
    await a.refresh()
    assert a.deciding


async def test_roles_hold_still_while_an_instance_drains_and_without_roles_enabled() -> None:
    store = MemoryStore()
    await put_records(store, _shared_record("prefill"), _shared_record("decode", draining=True),
                      ttl_s=60.0)  # fmt: skip
    a = await _replica(store, "a")
    a.arrived(time.monotonic(), 100_000)
    await a.refresh()
    assert a.deciding and a.view.roles == {"a/prefill-0": "prefill", "a/decode-0": "decode"}
    off = SharedRoles(Config(models=()), store, RegistryView(store, True), "off")
    off.arrived(time.monotonic(), 100_000)
    await off.refresh()
    assert not off.deciding and off.view.roles == {}


def test_shared_queues_give_the_backlog_the_demand_and_the_reserved_placement() -> None:
    lat = latency_model(["m"])
    queue = PrefillQueue()
    queue.add(Request("r0", "m", 0.0, 300, 8), 1)
    queue.add(Request("r1", "m", 0.0, 200, 8), 1)
    work_list = DecodeWorkList()
    work_list.add(Request("r2", "m", 0.0, 100, 8), 7)
    assert prefill_backlog([queue, PrefillQueue()]) == 500
    demand = decode_demands({"p": DecodeWorkList(), "d": work_list},
                            capacity_tokens={}, latency=lat, tbt_s=0.1)  # fmt: skip
    assert demand["p"] == 0.0 and demand["d"] > 0.0
    # an instance in the prefill role takes a new decode request only when no other is open
    capacity = {"p": {"m": 4096}, "d": {"m": 4096}}
    request = Request("r3", "m", 0.0, 100, 8)
    empty = {"d": DecodeWorkList(), "p": DecodeWorkList()}
    assert place_decode(empty, request, new_batch_id=9, capacity_tokens=capacity,
                        reserved={"d"})[0] == "p"  # fmt: skip
    assert place_decode({"d": DecodeWorkList()}, request, new_batch_id=9, capacity_tokens=capacity,
                        reserved={"d"})[0] == "d"  # fmt: skip
