"""Role switching by token velocity (fake clock), and the policy carrying it out safely."""

from __future__ import annotations

from aegaeon_sched import (
    AegaeonPolicy,
    EnqueuePrefill,
    LatencyModel,
    PlaceDecode,
    Request,
    RoleController,
    RoleMeter,
    RoleSettings,
    RoleSignals,
)
from aegaeon_sched.roles import DECODE, PREFILL, estimated_prefill_velocity
from sched_support import tiny_latency

V = {"p0": 1000.0, "d0": 1000.0, "d1": 1000.0}  # prompt tokens/s each prefills
SETTINGS = RoleSettings(high_util=0.8, low_util=0.5, up_hold_s=0.5, down_hold_s=5.0,
                        min_dwell_s=3.0, backlog_horizon_s=5.0,
                        convert_max_demand=1.0)  # fmt: skip


def _ctl() -> RoleController:
    return RoleController({"p0": PREFILL, "d0": DECODE, "d1": DECODE}, SETTINGS)


def _sig(arrival: float, backlog: int = 0, demand: dict[str, float] | None = None,
         busy: dict[str, float] | None = None) -> RoleSignals:  # fmt: skip
    return RoleSignals(arrival, backlog, V, demand or {}, busy or {})


def _run(
    ctl: RoleController, t0: float, t1: float, sig: RoleSignals, step: float = 0.25
) -> list[tuple[float, str, str]]:
    changes = []
    t = t0
    while t <= t1 + 1e-9:
        changes += [(t, c.instance, c.role) for c in ctl.observe(t, sig)]
        t += step
    return changes


def test_a_burst_converts_a_decoder_after_the_hold_and_back_after_the_longer_hold() -> None:
    ctl = _ctl()
    assert _run(ctl, 0.0, 10.0, _sig(500.0)) == []  # 50% of one prefiller: nothing moves
    # A burst: 2000 tokens/s against 1000 of capacity.
    up = _run(ctl, 10.0, 11.0, _sig(2000.0, demand={"d0": 0.6, "d1": 0.2}))
    assert up == [(10.5, "d1", PREFILL)]  # after 0.5 s; the decoder with less decode work
    # Still over 80% of the 2000 tokens/s two prefillers give: after another hold (it
    # restarts at every change) d0 converts too.
    more = _run(ctl, 10.75, 12.0, _sig(1900.0, demand={"d0": 0.6}))
    assert more == [(11.25, "d0", PREFILL)]
    assert ctl.instances(PREFILL) == ["p0", "d0", "d1"]
    # The burst ends; demand is in the band (between 50% and 80% of what is left without
    # one): no flapping.
    assert _run(ctl, 12.25, 30.0, _sig(1100.0)) == []
    # Well under: the converted ones go back, one per down hold, after their dwell.
    back = _run(ctl, 30.25, 45.0, _sig(300.0))
    assert [(i, r) for _, i, r in back] == [("d0", DECODE), ("d1", DECODE)]
    assert back[0][0] >= 30.25 + SETTINGS.down_hold_s
    assert back[1][0] - back[0][0] >= SETTINGS.down_hold_s
    assert ctl.roles == ctl.base_roles


def test_a_short_spike_under_the_hold_moves_nothing() -> None:
    ctl = _ctl()
    assert _run(ctl, 0.0, 0.25, _sig(5000.0)) == []  # 0.25 s < up_hold
    assert _run(ctl, 0.5, 2.0, _sig(100.0)) == []


def test_the_backlog_counts_as_demand() -> None:
    ctl = _ctl()
    # No arrivals, but 6000 queued tokens to clear within 5 s: 1200 tokens/s.
    changes = _run(ctl, 0.0, 1.0, _sig(0.0, backlog=6000))
    assert [(i, r) for _, i, r in changes] == [("d0", PREFILL)]


def test_decode_pressure_moves_a_prefiller_to_decode_but_keeps_one() -> None:
    ctl = RoleController({"p0": PREFILL, "p1": PREFILL, "d0": DECODE},
                         RoleSettings(min_dwell_s=0.0, up_hold_s=0.5))  # fmt: skip
    v = {"p0": 1000.0, "p1": 1000.0, "d0": 1000.0}
    heavy = RoleSignals(100.0, 0, v, {"d0": 1.0, "p0": 0.9, "p1": 0.9}, {"p0": 0.1, "p1": 0.1})
    changes = []
    for k in range(20):
        changes += [(c.instance, c.role) for c in ctl.observe(k * 0.25, heavy)]
    assert changes == [("p0", DECODE)]  # p1 stays: min_prefill = 1
    assert ctl.instances(PREFILL) == ["p1"]


def test_min_decode_keeps_a_decoder() -> None:
    ctl = RoleController({"p0": PREFILL, "d0": DECODE}, RoleSettings(min_decode=1))
    for k in range(10):
        assert ctl.observe(k * 0.25, RoleSignals(10_000.0, 0, {"p0": 1.0, "d0": 1.0})) == []


def _latency() -> LatencyModel:
    lat = tiny_latency("abc", switch_s=0.1)
    lat.set_decode_coefficients("*", [1e-4, 0.0])
    return lat


def test_the_profile_gives_a_velocity_before_any_measurement() -> None:
    assert estimated_prefill_velocity(_latency(), ["a"]) == 1000.0


def test_the_policy_drains_a_role_safely_and_releases_held_work() -> None:
    policy = AegaeonPolicy(["p0", "d0"], ["d0", "p0"], _latency(), standby=["d0"])
    first = policy.on_arrival(Request("r0", "a", 0.0, 100, 8), 0.0)
    assert [a.instance for a in first if isinstance(a, EnqueuePrefill)] == ["p0"]  # d0: standby
    assert policy.set_role("d0", PREFILL, 0.1) == []
    policy.on_arrival(Request("r1", "a", 0.1, 100, 8), 0.1)  # r0's group is open: joins p0
    other = policy.on_arrival(Request("r2", "a", 0.2, 100, 8, priority=0, ttft_s=1.0), 0.2)
    assert [a.instance for a in other if isinstance(a, EnqueuePrefill)] == ["d0"]
    # p0 leaves the prefill role: its queue still runs to the end, nothing new joins it.
    policy.set_role("p0", DECODE, 0.3)
    job = policy.next_prefill("p0", 0.3)
    assert job is not None and job.request.request_id == "r0"
    late = policy.on_arrival(Request("r3", "a", 0.4, 100, 8), 0.4)
    assert [a.instance for a in late if isinstance(a, EnqueuePrefill)] == ["d0"]
    # A drain pause and the role are kept apart: d0 paused and in standby -> arrivals wait.
    policy.set_role("d0", DECODE, 0.5)
    policy.pause("p0")
    assert policy.on_arrival(Request("r4", "a", 0.5, 100, 8), 0.5) == []
    assert "r4" in policy.held_arrivals
    released = policy.set_role("d0", PREFILL, 0.6)  # p0 is still paused (draining)
    assert [(a.instance, a.request.request_id) for a in released
            if isinstance(a, EnqueuePrefill)] == [("d0", "r4")]  # fmt: skip
    policy.resume("p0", 0.7)
    assert policy.prefill_role("p0") is False  # resuming from a drain keeps the role


def test_a_busy_decoder_is_not_converted() -> None:
    """Every prefill of a converted decoder stalls the decode work it holds: only a
    decoder with little of it converts, and none while the rest could not carry it."""
    ctl = RoleController({"p0": PREFILL, "d0": DECODE, "d1": DECODE})  # the defaults
    busy = _sig(5000.0, demand={"d0": 0.7, "d1": 0.5})
    assert _run(ctl, 0.0, 3.0, busy) == []
    # d1 nearly idle, but d0 alone could not carry the cluster's decode demand
    crowded = _sig(5000.0, demand={"d0": 1.0, "p0": 0.5, "d1": 0.1}, busy={"p0": 1.0})
    assert _run(ctl, 3.25, 6.0, crowded) == []
    light = _sig(5000.0, demand={"d0": 0.7, "d1": 0.1})
    assert [(i, r) for _, i, r in _run(ctl, 6.25, 7.0, light)] == [("d1", PREFILL)]


def _decoded_on(actions: list[object]) -> list[str]:
    return [a.instance for a in actions if isinstance(a, PlaceDecode)]


def _prefilled(policy: AegaeonPolicy, rid: str, model: str, t: float) -> list[str]:
    policy.on_arrival(Request(rid, model, t, 100, 8), t)
    instance = policy.prefill.instance_of(rid)
    assert instance is not None
    return _decoded_on(policy.on_prefill_done(instance, rid, 0.0, t))


def test_an_instance_in_the_prefill_role_gets_no_new_decode_work() -> None:
    """Fails without role_switching's placement: d1 is empty (the least loaded) and
    would take the new batch although it is prefilling."""
    lat = _latency()
    policy = AegaeonPolicy(["p0", "d0", "d1"], ["d0", "d1"], lat, decode_tbt_s=100.0,
                           standby=["d0", "d1"], role_switching=True)  # fmt: skip
    policy.set_role("d1", PREFILL, 0.0)  # d1 converts: a burst
    assert policy.decode.reserved == {"d1"}
    # d0 already decodes model a; b's request would open on the emptier d1
    assert _prefilled(policy, "r0", "a", 0.0) == ["d0"]
    assert _prefilled(policy, "r1", "b", 0.1) == ["d0"]
    # back to decode: it takes new work again
    policy.set_role("d1", DECODE, 1.0)
    assert not policy.decode.reserved
    assert _prefilled(policy, "r2", "c", 1.1) == ["d1"]


def test_a_prefill_role_instance_decodes_when_no_decode_role_one_keeps_up() -> None:
    lat = _latency()
    policy = AegaeonPolicy(["p0", "d0"], ["d0", "p0"], lat, decode_tbt_s=100.0,
                           standby=["d0"], role_switching=True)  # fmt: skip
    assert policy.decode.reserved == {"p0"}
    policy.decode.set_decode_share("d0", 1e-3)  # d0 cannot keep up with anything more
    assert _prefilled(policy, "r0", "a", 0.0) == ["p0"]
    policy.pause("d0")  # and with the only decode-role instance draining
    policy.decode.set_decode_share("d0", 1.0)
    assert _prefilled(policy, "r1", "b", 0.1) == ["p0"]


def test_without_role_switching_a_hybrid_prefill_instance_is_placed_on_by_load() -> None:
    policy = AegaeonPolicy(["p0"], ["d0", "p0"], _latency(), decode_tbt_s=100.0)
    assert _prefilled(policy, "r0", "a", 0.0) == ["d0"]
    assert _prefilled(policy, "r1", "b", 0.1) == ["p0"]  # the emptier: the hybrid rule


def test_the_meter_measures_busy_shares_and_velocities_between_heartbeats() -> None:
    meter = RoleMeter(beat_every_s=1.0, min_measured_s=0.2)
    for t, busy_s in ((0.0, 10.0), (0.5, 10.2), (2.0, 11.0)):  # 0.5: too soon, not metered
        meter.beat("p0", t, busy_s)
    assert meter.busy == {"p0": 0.5}
    meter.beat("p0", 2.1, 0.0)  # the counter went back (a restart): starts over
    meter.beat("p0", 3.1, 2.0)
    assert meter.busy == {"p0": 1.0}  # at most all of the time
    assert meter.measured(100, 0.1, 0.1) is None  # too little prefilled: the driver estimates
    assert meter.measured(1000, 0.5, 2.0) == 500.0  # per busy second
    meter.arrived(3.0, 4000)
    sig = meter.signals(3.5, backlog_tokens=10, prefill_velocity=V, decode_demand={"d0": 0.5})
    assert sig == RoleSignals(2000.0, 10, V, {"d0": 0.5}, {"p0": 1.0})
