"""The proxy's role switching driver (no processes): the instances' records and
arrivals in, role changes out (``AegaeonPolicy.set_role`` carries one out in the
simulator, the roles record in dispatch); velocity metrics."""

from __future__ import annotations

from typing import cast

import msgspec
from aegaeon_common.config import Config, RolesConfig
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.registry import InstanceLoadInfo, InstanceRecord
from aegaeon_common.store import MemoryStore
from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.roles import Meter, RoleSwitcher, record_meter
from aegaeon_sched import AegaeonPolicy, EnqueuePrefill, Request, RoleChange, RoleLoad
from fake_worker import latency_model

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


def _meters(prefill_tokens: float, prefill_s: float) -> list[Meter]:
    return [record_meter(_record(n, prefill_tokens, prefill_s)) for n in BASE]


def _observe(switcher: RoleSwitcher, now_s: float, load: RoleLoad, meters: list[Meter],
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
    switcher = RoleSwitcher(Config(models=(), roles=ROLES), BASE, enabled=True)
    policy = _policy()
    meters = _meters(1000.0, 1.0)  # measured: 1000 prompt tokens/s while prefilling
    assert _observe(switcher, 0.0, _load(policy), meters, alive=True) == []  # nothing arrives
    switcher.arrived(0.1, 4000)  # 2000 tokens/s over the 2 s window > 0.5 x 1000
    (up,) = _observe(switcher, 0.2, _load(policy), meters, alive=True)
    assert (up.instance, up.role) == ("decode-0", "prefill")
    assert switcher.role("decode-0") == "prefill" and switcher.switches["prefill"] == 1
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
    snap = switcher.snapshot(4.1, {})
    assert snap["roles"] == {"prefill-0": "prefill", "decode-0": "decode"}
    changes = cast(list[dict[str, object]], snap["changes"])
    assert [c["role"] for c in changes] == ["prefill", "decode"]


def test_roles_hold_still_while_an_instance_is_down_or_switching_is_off() -> None:
    meters = _meters(1000.0, 1.0)
    policy = _policy()
    switcher = RoleSwitcher(Config(models=(), roles=ROLES), BASE, enabled=True)
    switcher.arrived(0.0, 100_000)
    assert _observe(switcher, 0.1, _load(policy), meters, alive=False) == []
    off = RoleSwitcher(Config(models=(), roles=ROLES), BASE, enabled=False)
    off.arrived(0.0, 100_000)
    assert _observe(off, 0.1, _load(policy), meters, alive=True) == []
    assert off.roles == {"prefill-0": "prefill", "decode-0": "decode"}


def test_velocity_is_measured_once_an_instance_has_prefilled_else_estimated() -> None:
    switcher = RoleSwitcher(Config(models=()), BASE, enabled=False)
    lat = latency_model(["a"])
    prefill = record_meter(_record("prefill-0", 3000.0, 1.5))
    decode = record_meter(_record("decode-0", 0.0, 0.0, {"a": 4096}))
    assert switcher.prefill_velocity(prefill, lat) == 2000.0
    assert switcher.prefill_velocity(decode, lat) > 0  # from a profile (here the fallback)
    # the busy share follows prefill_s between two heartbeats
    switcher.heartbeat(prefill, 10.0)
    switcher.heartbeat(record_meter(_record("prefill-0", 3500.0, 1.75)), 10.5)
    assert switcher.busy["prefill-0"] == 0.5


def test_an_instance_in_the_prefill_role_takes_prefill_work_and_decodes_last() -> None:
    """Dispatch by the roles: decode-0 moved to the prefill role is a prefill candidate;
    with hybrid prefill every instance of the node decodes, decode instances first."""
    lat = msgspec.convert(latency_model(["a"]).to_dict(), LatencyProfile)
    view = RegistryView(cast(MemoryStore, None), hybrid_prefill=True)
    view.live = {n: _record(n, 0.0, 0.0, {"a": 4096}, lat) for n in BASE}
    assert [r.instance_id for r in view.prefill_candidates()] == ["prefill-0"]
    view.roles = {"decode-0": "prefill"}
    assert [r.instance_id for r in view.prefill_candidates()] == ["decode-0", "prefill-0"]
    assert [r.instance_id for r in view.decode_candidates("local")] == ["decode-0", "prefill-0"]
