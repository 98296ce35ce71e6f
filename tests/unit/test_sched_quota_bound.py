"""Past the paper: the round bound, fresh-first ordering and re-planning."""

from __future__ import annotations

import pytest
from aegaeon_sched import (
    BatchLoad,
    DecodeShare,
    DecodeWorkList,
    LatencyModel,
    ModelSpec,
    Request,
    RoundRobinPlanner,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _example() -> list[BatchLoad]:
    return [BatchLoad(i, m, 0.025) for i, m in enumerate("abc")]


def test_paper_mode_keeps_the_worked_example() -> None:
    """d = 0.1, t = 0.025, c = 3, Q_MAX = 3: alpha 1, q = 3 s, a 12 s round."""
    switch = {"a": 1.0, "b": 1.0, "c": 1.0}
    for planner in (
        RoundRobinPlanner.paper(tbt_s=0.1, q_max_s=3.0),
        RoundRobinPlanner(0.1, 3.0),  # no TTFT given: no bound
        RoundRobinPlanner(0.1, 3.0, ttft_s=10.0, round_ttft_fraction=None),
        RoundRobinPlanner(0.1, 3.0, ttft_s=20.0),  # 9 s of quotas fit 0.7 x 20 s
    ):
        plan = planner.plan(_example(), switch)
        assert plan.alpha == pytest.approx(1.0)
        assert [t.quota_s for t in plan.turns] == pytest.approx([3.0, 3.0, 3.0])
        assert plan.round_s == pytest.approx(12.0)


def test_the_bound_shrinks_the_worked_example_evenly() -> None:
    planner = RoundRobinPlanner(0.1, 3.0, ttft_s=10.0, round_ttft_fraction=0.6)  # <= 6 s
    plan = planner.plan(_example(), {"a": 1.0, "b": 1.0, "c": 1.0})
    assert [t.quota_s for t in plan.turns] == pytest.approx([2.0, 2.0, 2.0])
    # Each batch emits 80 tokens in a 9 s round that needs 90: attainment 8/9.
    assert plan.alpha == pytest.approx(9 / 8)
    assert plan.round_s == pytest.approx(9.0)


@pytest.mark.parametrize("share", [1.0, 0.8, 0.5])
def test_a_decode_share_keeps_each_batch_on_its_wall_clock_pace(share: float) -> None:
    """Prefills take 1 - share of a hybrid's time: a round of quotas q and
    switches c lasts (sum q + c) / share on the wall clock, and every batch
    still earns 1/alpha of the tokens its deadlines ask for in that time."""
    loads = [BatchLoad(0, "a", 0.01), BatchLoad(1, "b", 0.02), BatchLoad(2, "c", 0.015)]
    switch = {"a": 0.2, "b": 0.1, "c": 0.3}
    for planner in (RoundRobinPlanner(0.1, 4.0), RoundRobinPlanner(0.1, 4.0, ttft_s=2.0)):
        plan = planner.plan(loads, switch, decode_share=share)
        wall_s = (sum(t.quota_s for t in plan.turns) + plan.switch_s) / share
        for turn, load in zip(plan.turns, loads, strict=True):
            earned = turn.quota_s / load.step_s
            assert earned / (wall_s / 0.1) == pytest.approx(1 / plan.alpha)
        if planner.round_bound_s is not None:  # the bound holds on the wall clock
            assert sum(t.quota_s for t in plan.turns) / share <= planner.round_bound_s + 1e-9
    with pytest.raises(ValueError):
        RoundRobinPlanner().plan(loads, switch, decode_share=0.0)


def test_decode_share_smooths_the_prefill_busy_fraction() -> None:
    share = DecodeShare(smoothing=0.5, min_interval_s=0.5)
    assert share.observe(0.0, 0.0) == 1.0  # nothing to compare with yet
    assert share.observe(1.0, 0.4) == pytest.approx(0.6)  # the first fraction as is
    assert share.observe(1.2, 0.6) == pytest.approx(0.6)  # too soon: ignored
    assert share.observe(2.0, 0.4 + 0.8) == pytest.approx(1 - (0.4 + 0.5 * (0.8 - 0.4)))
    assert share.observe(3.0, 0.0) == share.share  # a counter reset is not an observation
    assert share.observe(4.0, 5.0) == pytest.approx(share.share) and share.share >= 0.0
    busy = DecodeShare()
    busy.observe(0.0, 0.0)
    assert busy.observe(1.0, 1.0) > 0  # all prefill: still a share a planner can divide by
    assert RoundRobinPlanner(0.1, ttft_s=2.0).plan(
        [BatchLoad(0, "a", 0.01), BatchLoad(1, "b", 0.01)], {"a": 0.1, "b": 0.1},
        decode_share=busy.share,
    ).turns


def test_one_model_rounds_are_bounded_too() -> None:
    planner = RoundRobinPlanner(0.1, 4.0, ttft_s=5.0, round_ttft_fraction=0.6)  # 3 s
    plan = planner.plan([BatchLoad(i, "a", 0.02) for i in range(3)], {"a": 0.5})
    assert plan.switch_s == 0.0
    assert [t.quota_s for t in plan.turns] == pytest.approx([1.0, 1.0, 1.0])
    assert planner.plan([BatchLoad(0, "a", 0.02)], {"a": 0.5}).turns[0].quota_s == 3.0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcdefgh"), st.floats(1e-3, 0.3)), min_size=1, max_size=16),
    st.floats(1e-3, 2.0),
    st.floats(0.5, 20.0),
    st.sampled_from([0.3, 0.7, 1.0]),
)
def test_round_bound_holds_for_random_work_lists(
    items: list[tuple[str, float]], switch: float, ttft: float, fraction: float
) -> None:
    planner = RoundRobinPlanner(0.1, 4.0, ttft_s=ttft, round_ttft_fraction=fraction)
    paper = RoundRobinPlanner.paper(0.1, 4.0)
    batches = [BatchLoad(i, m, t) for i, (m, t) in enumerate(items)]
    switches = dict.fromkeys("abcdefgh", switch)
    plan, ref = planner.plan(batches, switches), paper.plan(batches, switches)
    steps = {i: t for i, (_, t) in enumerate(items)}
    # The bound: the quotas sum to at most f x TTFT, except those raised to
    # one step (every batch still advances every round).
    raised = [t.quota_s <= steps[t.batch_id] * (1 + 1e-9) for t in plan.turns]
    free = sum(t.quota_s for t, r in zip(plan.turns, raised, strict=True) if not r)
    assert free <= fraction * ttft * (1 + 1e-9)
    assert [t.batch_id for t in plan.turns] == [t.batch_id for t in ref.turns]
    for turn, paper_turn in zip(plan.turns, ref.turns, strict=True):
        assert steps[turn.batch_id] <= turn.quota_s <= paper_turn.quota_s + 1e-12
    assert plan.alpha >= ref.alpha - 1e-12
    if plan.switch_s > 0 and not any(raised):
        # Eq. 2's proportions hold: every batch earns 1/alpha of its tokens.
        for turn in plan.turns:
            earned = turn.quota_s / steps[turn.batch_id]
            assert earned / (plan.round_s / 0.1) == pytest.approx(1 / plan.alpha, rel=1e-6)


def test_fresh_batches_first_and_served_ones_last() -> None:
    batches = [
        BatchLoad(0, "a", 0.01, served=True),
        BatchLoad(1, "b", 0.01),
        BatchLoad(2, "c", 0.01),
        BatchLoad(3, "d", 0.01, fresh=True),
        BatchLoad(4, "a", 0.01),
    ]
    switch = dict.fromkeys("abcd", 0.3)
    default = RoundRobinPlanner(0.1, 4.0).plan(batches, switch)
    assert [t.batch_id for t in default.turns] == [1, 2, 3, 4, 0]  # a stays adjacent
    fresh = RoundRobinPlanner(0.1, 4.0, fresh_first=True).plan(batches, switch)
    assert [t.batch_id for t in fresh.turns] == [3, 1, 2, 4, 0]


def test_replan_due() -> None:
    planner, fresh = RoundRobinPlanner(0.1, 4.0), RoundRobinPlanner(0.1, 4.0, fresh_first=True)
    two = planner.plan([BatchLoad(0, "a", 0.01), BatchLoad(1, "b", 0.01)], {"a": 1, "b": 1})
    one = planner.plan([BatchLoad(0, "a", 0.01)], {"a": 1})
    for p in (planner, fresh):
        assert not p.replan_due(two, [0, 1], mid_turn=False)
        assert not p.replan_due(two, [1], mid_turn=True)  # a batch left: nothing to do
        # A one-model round ends as soon as another batch arrives.
        assert p.replan_due(one, [0, 7], mid_turn=True)
        assert not p.replan_due(two, [0, 1, 7], mid_turn=True)
    assert not planner.replan_due(two, [0, 1, 7], mid_turn=False)
    assert fresh.replan_due(two, [0, 1, 7], mid_turn=False)


def test_plan_work_list_marks_fresh_and_served_batches() -> None:
    specs = [ModelSpec(m, 64, 128, 1, 2_000_000_000, 1) for m in "abc"]
    lat = LatencyModel(specs, pcie_bytes_per_s=1e9, switch_beta=0.5)
    lat.set_decode_coefficients("*", [0.02 / specs[0].layer_width, 0.0])
    wl = DecodeWorkList()
    for i, model in enumerate("abc"):
        wl.add(Request(f"r{i}", model, 0.0, 10, 10), i)
    planner = RoundRobinPlanner(0.1, 4.0, fresh_first=True)
    plan = planner.plan_work_list(wl, lat, lambda rid: 20, turned_ids={0, 1}, served_ids={0})
    assert [t.batch_id for t in plan.turns] == [2, 1, 0]
    plan = planner.plan_work_list(wl, lat, lambda rid: 20)  # nothing known: none fresh
    assert [t.batch_id for t in plan.turns] == [0, 1, 2]
