"""Request-level auto-scaling with a global queue (FCFS / SJF), static
multiplexing, and the policy table. The bound-at-arrival ServerlessLLM(+)
baselines: test_sched_pinned.py."""

from __future__ import annotations

import pytest
from aegaeon_sched import (
    SLO,
    AegaeonPolicy,
    Cancel,
    ClusterSpec,
    EnqueuePrefill,
    LatencyModel,
    PinnedRequestLevelPolicy,
    PlaceDecode,
    Reject,
    RequestLevelPolicy,
    RequestTrace,
    RunOnInstance,
    StaticMuxPolicy,
    attainment,
    make_policy,
)
from sched_support import req, run_actions, tiny_latency


def _latency() -> LatencyModel:
    # 50 tokens' prefill: 5 ms; 10 ms per decode step; 0.5 s switches
    return tiny_latency("xyz", prefill_s=1e-4, decode_s=0.01, switch_s=0.5)


def test_hol_blocking_request_level_vs_token_level() -> None:
    """One GPU's worth of work: a long request of x, then a short one of y.

    Request level: y waits for x to finish (1000 steps of 10 ms), then a
    switch: its first token comes ~10.5 s after arrival and misses the 10 s
    TTFT. Token level: y is prefilled at once on the prefill instance and
    shares the decode instance by turns.
    """
    slo = SLO(10.0, 0.1)
    long_x, short_y = req(0, "x", 0.0, out=1000), req(1, "y", 0.1, out=5)
    step, switch, prefill = 0.01, 0.5, 0.005

    fcfs = RequestLevelPolicy(["gpu0"])
    assert fcfs.on_arrival(long_x, 0.0) == [RunOnInstance("gpu0", long_x, "x")]
    assert fcfs.on_arrival(short_y, 0.1) == []  # head-of-line blocked
    x_done = switch + prefill + (1000 - 1) * step
    assert fcfs.on_request_finished("r0", x_done) == [RunOnInstance("gpu0", short_y, "y")]
    y_first = x_done + switch + prefill
    y_fcfs = RequestTrace("r1", 0.1, 5, [y_first + k * step for k in range(5)])

    aeg = AegaeonPolicy(["p0"], ["d0"], _latency())
    assert isinstance(aeg.on_arrival(long_x, 0.0)[0], EnqueuePrefill)
    x_prefilled = switch + prefill
    [place_x] = aeg.on_prefill_done("p0", "r0", prefill, x_prefilled)
    assert isinstance(place_x, PlaceDecode)
    assert isinstance(aeg.on_arrival(short_y, 0.1)[0], EnqueuePrefill)
    y_prefilled = x_prefilled + switch + prefill  # right after x's prefill
    [place_y] = aeg.on_prefill_done("p0", "r1", prefill, y_prefilled)
    assert isinstance(place_y, PlaceDecode)
    assert place_y.instance == "d0" and place_y.batch_id != place_x.batch_id
    # On d0 the y batch gets its turn within one quota (<= 4 s) plus a switch.
    y_turn = y_prefilled + 4.0 + switch
    y_aeg = RequestTrace("r1", 0.1, 5, [y_prefilled] + [y_turn + k * step for k in range(4)])

    assert attainment([y_fcfs], slo) == 0.0  # every token late
    assert attainment([y_aeg], slo) == 1.0


def test_idle_instance_takes_the_queue_head_and_its_model_mates() -> None:
    p = RequestLevelPolicy(["g0", "g1"])
    p.on_arrival(req(0, "x", 0.0), 0.0)  # g0 <- x
    p.on_arrival(req(1, "y", 0.1), 0.1)  # g1 <- y
    assert p.on_arrival(req(2, "x", 0.2), 0.2) == [RunOnInstance("g0", req(2, "x", 0.2), "x")]
    for i, (m, t) in enumerate([("z", 0.3), ("y", 0.4), ("z", 0.5)], start=3):
        # y is loaded on g1 with room: joins at once; z is loaded nowhere: queued
        acts = p.on_arrival(req(i, m, t), t)
        assert acts == ([RunOnInstance("g1", req(i, m, t), "y")] if m == "y" else [])
    assert [r.request_id for r in p.queue] == ["r3", "r5"]
    assert p.on_request_finished("r0", 5.0) == []  # g0 still runs r2
    acts = p.on_request_finished("r2", 6.0)  # g0 idle: scales to z, takes both
    assert run_actions(acts) == [("g0", "r3", "z"), ("g0", "r5", "z")]
    assert p.queue == []


def test_sjf_orders_the_queue_by_oracle_output_length() -> None:
    for sjf, first in ((False, "r1"), (True, "r2")):
        p = RequestLevelPolicy(["g0"], sjf=sjf)
        p.on_arrival(req(0, "x", 0.0, out=500), 0.0)
        p.on_arrival(req(1, "y", 0.1, out=400), 0.1)
        p.on_arrival(req(2, "z", 0.2, out=10), 0.2)
        assert [rid for _, rid, _ in run_actions(p.on_request_finished("r0", 9.0))] == [first]


def test_batch_limits_keep_requests_queued() -> None:
    p = RequestLevelPolicy(["g0"], max_batch_size=2, capacity_tokens={"x": 10_000})
    assert len(p.on_arrival(req(0, "x", 0.0), 0.0)) == 1
    assert len(p.on_arrival(req(1, "x", 0.1), 0.1)) == 1
    assert p.on_arrival(req(2, "x", 0.2), 0.2) == []  # batch full
    # room again: the queued x joins
    assert run_actions(p.on_request_finished("r0", 1.0)) == [("g0", "r2", "x")]


def test_cancel_frees_room_and_leaves_queue() -> None:
    p = RequestLevelPolicy(["g0"])
    p.on_arrival(req(0, "x", 0.0), 0.0)
    p.on_arrival(req(1, "y", 0.1), 0.1)
    p.on_arrival(req(2, "z", 0.2), 0.2)
    assert p.on_request_cancelled("r1", 0.3) == []  # was only queued
    acts = p.on_request_cancelled("r0", 0.4)
    assert acts[0] == Cancel("g0", "r0")
    assert run_actions(acts[1:]) == [("g0", "r2", "z")]


def test_static_mux_places_at_most_two_models_per_gpu() -> None:
    loads = {f"m{i}": 1.0 for i in range(7)} | {"hot": 5.0}
    p = StaticMuxPolicy(["g0", "g1", "g2"], loads)
    per_gpu: dict[str, list[str]] = {}
    for model, gpu in p.placement.items():
        per_gpu.setdefault(gpu, []).append(model)
    assert sorted(len(v) for v in per_gpu.values()) == [2, 2, 2]
    # Heaviest first, each onto the least-loaded GPU with a free slot: the hot
    # model's GPU is the last to get a second model.
    assert per_gpu[p.placement["hot"]] == ["hot", "m4"]
    unplaced = [m for m in loads if m not in p.placement]
    assert len(unplaced) == 2
    assert isinstance(p.on_arrival(req(0, unplaced[0], 0.0), 0.0)[0], Reject)
    act = p.on_arrival(req(1, "hot", 0.0), 0.0)[0]
    assert act == RunOnInstance(p.placement["hot"], req(1, "hot", 0.0), "hot")


def test_static_mux_respects_the_weight_budget() -> None:
    p = StaticMuxPolicy(
        ["g0", "g1"],
        {"big": 1.0, "small": 1.0, "tiny": 1.0},
        weight_bytes={"big": 30, "small": 20, "tiny": 10},
        gpu_weight_budget_bytes=35,
    )
    assert p.placement == {"big": "g0", "small": "g1", "tiny": "g1"}


def test_factory_builds_every_policy_by_name() -> None:
    cluster = ClusterSpec(("p0",), ("d0", "d1"))
    for name in (
        "aegaeon", "request-level", "request-level-sjf", "request-level-global",
        "request-level-global-sjf", "request-level-charged", "static-mux",
    ):  # fmt: skip
        assert make_policy(name, cluster, _latency()).name == name
    # ServerlessLLM(+) as the paper evaluated them bind requests at arrival.
    assert isinstance(make_policy("request-level", cluster, _latency()), PinnedRequestLevelPolicy)
    assert isinstance(
        make_policy("request-level-sjf", cluster, _latency()), PinnedRequestLevelPolicy
    )
    assert not isinstance(
        make_policy("request-level-global", cluster, _latency()), PinnedRequestLevelPolicy
    )


def test_config_policies_are_factory_policies() -> None:
    from aegaeon_common.config import POLICIES as CONFIG_POLICIES
    from aegaeon_common.config import UNIFIED_POLICIES
    from aegaeon_sched import POLICIES

    assert set(CONFIG_POLICIES) <= set(POLICIES)
    # Unified (every worker prefills and decodes): every baseline
    assert set(UNIFIED_POLICIES) == set(POLICIES) - {"aegaeon"}
    assert set(CONFIG_POLICIES) == set(POLICIES)  # every policy can be served


def test_the_charged_baseline_is_request_level_with_a_load_path() -> None:
    """``request-level-charged`` decides as ``request-level`` does; its scale-ups cost
    ``init_s + bytes / load_gb_s`` (the paper's ServerlessLLM), at least what this
    system's switch took."""
    from aegaeon_sched import CHARGED_POLICIES, LoadPath, load_path_for

    cluster = ClusterSpec(("p0",), ("d0", "d1"))
    charged = make_policy("request-level-charged", cluster, _latency())
    plain = make_policy("request-level", cluster, _latency())
    assert isinstance(charged, PinnedRequestLevelPolicy) and charged.name != plain.name
    for i, model in enumerate("xyxzy"):
        request = req(i, model, 0.1 * i)
        assert charged.on_arrival(request, 0.1 * i) == plain.on_arrival(request, 0.1 * i)
    assert CHARGED_POLICIES == ("request-level-charged",)
    path = load_path_for("request-level-charged", 16.0, 2.0)
    assert path == LoadPath(16e9, 2.0) and path.scale_up_s(16_060_000_000) == 3.00375
    assert path.charge_s(16_060_000_000, 0.5) == pytest.approx(2.50375)
    assert path.charge_s(16_060_000_000, 9.0) == 0.0  # a slower switch owes nothing
    assert path.switch_s(16_060_000_000, 9.0) == 9.0
    assert load_path_for("request-level", 16.0, 2.0) is None
    for bad in ((0.0, 0.0), (-1.0, 0.0), (16.0, -1.0)):
        with pytest.raises(ValueError):
            LoadPath.of(*bad)


def test_static_mux_refuses_an_unplaced_model_naming_the_placed_ones() -> None:
    p = StaticMuxPolicy(["g0"], {"a": 2.0, "b": 1.0, "c": 0.5}, max_models_per_gpu=2)
    (refusal,) = p.on_arrival(req(0, "c", 0.0), 0.0)
    assert isinstance(refusal, Reject) and refusal.code == "no_slot"
    assert "'c'" in refusal.reason and "a, b" in refusal.reason
