"""The proxy's role switching driver (no processes): heartbeats and arrivals in,
``AegaeonPolicy.set_role`` changes out; the policy built for moving roles; velocity
metrics."""

from __future__ import annotations

from typing import Any, cast

import msgspec
from aegaeon_common.config import Config, RolesConfig, SchedulerConfig
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_proxy.cluster.instances import InstanceView
from aegaeon_proxy.cluster.policy import build_policy
from aegaeon_proxy.cluster.roles import RoleSwitcher, view_meter
from aegaeon_sched import AegaeonPolicy, EnqueuePrefill, Request, RoleLoad
from fake_worker import latency_model

ROLES = RolesConfig(enabled=True, high_util=0.5, low_util=0.2, up_hold_s=0.0, down_hold_s=1.0,
                    min_dwell_s=0.5)  # fmt: skip


BASE = {"prefill-0": "prefill", "decode-0": "decode"}


def _views() -> list[InstanceView]:
    views = [InstanceView("prefill-0", "prefill", 0, cast(Any, None), pid=1),
             InstanceView("decode-0", "decode", 0, cast(Any, None), pid=2)]  # fmt: skip
    for view in views:
        view.last_seen_s = float("inf")
    return views


def _beat(view: InstanceView, prefill_tokens: float, prefill_s: float, **velocity: float) -> None:
    counters = {"prefill_tokens": prefill_tokens, "prefill_s": prefill_s}
    view.stats = InstanceStats(view.kind, view.index, None, 0, 0, counters, velocity=velocity)


def _policy() -> AegaeonPolicy:
    return AegaeonPolicy(["prefill-0", "decode-0"], ["decode-0", "prefill-0"],
                         latency_model(["a", "b"]), standby=["decode-0"],
                         default_ttft_s=10.0)  # fmt: skip


def _load(policy: AegaeonPolicy) -> RoleLoad:
    load = policy.role_load()
    assert load is not None  # (roles move under the aegaeon policy)
    return load


def test_a_burst_moves_the_decode_instance_and_its_end_moves_it_back() -> None:
    views = _views()
    switcher = RoleSwitcher(Config(models=(), roles=ROLES), BASE, enabled=True)
    policy = _policy()
    for view in views:  # measured: 1000 prompt tokens/s while prefilling
        _beat(view, 1000.0, 1.0)
    assert switcher.observe(0.0, _load(policy), views, alive=True) == []  # nothing arrives
    switcher.arrived(0.1, 4000)  # 2000 tokens/s over the 2 s window > 0.5 x 1000
    (up,) = switcher.observe(0.2, _load(policy), views, alive=True)
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
    assert switcher.observe(3.0, _load(policy), views, alive=True) == []
    (back,) = switcher.observe(4.1, _load(policy), views, alive=True)
    assert (back.instance, back.role) == ("decode-0", "decode")
    snap = switcher.snapshot(4.1, {})
    assert snap["roles"] == {"prefill-0": "prefill", "decode-0": "decode"}
    changes = cast(list[dict[str, object]], snap["changes"])
    assert [c["role"] for c in changes] == ["prefill", "decode"]


def test_roles_hold_still_while_an_instance_is_down_or_switching_is_off() -> None:
    views = _views()
    for view in views:
        _beat(view, 1000.0, 1.0)
    policy = _policy()
    switcher = RoleSwitcher(Config(models=(), roles=ROLES), BASE, enabled=True)
    switcher.arrived(0.0, 100_000)
    assert switcher.observe(0.1, _load(policy), views, alive=False) == []
    off = RoleSwitcher(Config(models=(), roles=ROLES), BASE, enabled=False)
    off.arrived(0.0, 100_000)
    assert off.observe(0.1, _load(policy), views, alive=True) == []
    assert off.roles == {"prefill-0": "prefill", "decode-0": "decode"}


def test_velocity_is_measured_once_an_instance_has_prefilled_else_estimated() -> None:
    views = _views()
    switcher = RoleSwitcher(Config(models=()), BASE, enabled=False)
    lat = latency_model(["a"])
    _beat(views[0], 3000.0, 1.5, arrival=10.0, prefill=20.0, decode=5.0)
    _beat(views[1], 0.0, 0.0, decode=7.0)
    views[1].hello = InstanceHello("decode", 0, 2, 1 << 20, 1 << 20, 8, {"a": 4096})
    meters = [view_meter(v) for v in views]
    assert meters[0] is not None and meters[1] is not None
    assert switcher.prefill_velocity(meters[0], lat) == 2000.0
    assert switcher.prefill_velocity(meters[1], lat) > 0  # from a profile (here the fallback)
    # the busy share follows prefill_s between two heartbeats
    switcher.heartbeat(view_meter(views[0]), 10.0)
    _beat(views[0], 3500.0, 1.75)
    switcher.heartbeat(view_meter(views[0]), 10.5)
    assert switcher.busy["prefill-0"] == 0.5


def test_the_policy_for_moving_roles_lets_every_instance_prefill() -> None:
    config = Config(models=(), roles=ROLES, scheduler=SchedulerConfig())
    assert config.role_switching
    views = _views()
    instances = cast(Any, type("I", (), {"__iter__": lambda self: iter(views)})())
    lat = latency_model(["a"]).to_dict()
    for view in views:
        view.hello = InstanceHello(view.kind, view.index, view.pid or 0, 1 << 20, 1 << 20, 8,
                                   {"a": 4096}, msgspec.convert(lat, LatencyProfile))  # fmt: skip
    policy = build_policy(config, instances, unified=False)
    assert isinstance(policy, AegaeonPolicy)
    assert set(policy.prefill.queues) == {"prefill-0", "decode-0"}
    assert policy.prefill.standby == {"decode-0"}
    assert list(policy.decode.work_lists) == ["decode-0", "prefill-0"]
