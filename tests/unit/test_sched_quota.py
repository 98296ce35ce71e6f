"""Eq. 2-3 quotas: the paper's worked example and the edge cases."""

from __future__ import annotations

import pytest
from aegaeon_sched import (
    BatchLoad,
    DecodeWorkList,
    LatencyModel,
    ModelSpec,
    Request,
    RoundRobinPlanner,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def test_paper_worked_example() -> None:
    """d = 0.1, t = 0.025, c = 3, Q_MAX = 3, three batches -> alpha 1, q = 3 s."""
    planner = RoundRobinPlanner(tbt_s=0.1, q_max_s=3.0)
    batches = [BatchLoad(i, m, 0.025) for i, m in enumerate("abc")]
    plan = planner.plan(batches, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert plan.switch_s == pytest.approx(3.0)
    assert plan.alpha == pytest.approx(1.0)
    assert [t.quota_s for t in plan.turns] == pytest.approx([3.0, 3.0, 3.0])
    assert plan.round_s == pytest.approx(12.0)
    tokens = [t.quota_s / 0.025 for t in plan.turns]
    assert tokens == pytest.approx([120.0] * 3)
    # 120 tokens at the 100 ms TBT take exactly one 12 s round.
    assert tokens[0] * 0.1 == pytest.approx(plan.round_s)


def test_same_model_batches_are_adjacent_and_stable() -> None:
    planner = RoundRobinPlanner()
    batches = [BatchLoad(i, m, 0.02) for i, m in enumerate("abab")]
    plan = planner.plan(batches, {"a": 0.5, "b": 0.5})
    assert [t.batch_id for t in plan.turns] == [0, 2, 1, 3]
    # c counts each distinct model once
    assert plan.switch_s == pytest.approx(1.0)


def test_edge_cases() -> None:
    planner = RoundRobinPlanner(tbt_s=0.1, q_max_s=4.0)
    assert planner.plan([], {}).turns == ()
    single = planner.plan([BatchLoad(0, "a", 0.02)], {"a": 0.5})
    assert single.switch_s == 0.0 and single.turns[0].quota_s == 4.0
    one_model = planner.plan([BatchLoad(0, "a", 0.02), BatchLoad(1, "a", 0.03)], {"a": 0.5})
    assert [t.quota_s for t in one_model.turns] == [4.0, 4.0]
    # Steps slower than the TBT target: alpha > 1, quotas still positive and bounded.
    slow = planner.plan([BatchLoad(0, "a", 0.2), BatchLoad(1, "b", 0.15)], {"a": 1, "b": 1})
    assert slow.alpha > 1.0
    assert all(0.15 <= t.quota_s <= 4.0 for t in slow.turns)
    # No estimate yet (t = 0) does not divide by zero.
    zero = planner.plan([BatchLoad(0, "a", 0.0), BatchLoad(1, "b", 0.02)], {"a": 1, "b": 1})
    assert all(t.quota_s > 0 for t in zero.turns)


def test_alpha_floor_keeps_turns_short_when_slo_is_easy() -> None:
    planner = RoundRobinPlanner(tbt_s=0.1, q_max_s=4.0)
    plan = planner.plan([BatchLoad(0, "a", 0.01), BatchLoad(1, "b", 0.01)], {"a": 0.3, "b": 0.3})
    # sum 1/n = 0.2 and c/(min n Q_MAX) = 0.015: alpha is held at 0.5
    assert plan.alpha == 0.5
    assert plan.turns[0].quota_s == pytest.approx(0.6 / (10 * 0.3))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcdefg"), st.floats(1e-4, 0.5)), min_size=1, max_size=12),
    st.one_of(st.just(0.0), st.floats(1e-3, 2.0)),
)
def test_every_batch_gets_at_least_one_step_and_at_most_q_max(
    items: list[tuple[str, float]], switch: float
) -> None:
    planner = RoundRobinPlanner(tbt_s=0.1, q_max_s=4.0)
    batches = [BatchLoad(i, m, t) for i, (m, t) in enumerate(items)]
    plan = planner.plan(batches, dict.fromkeys("abcdefg", switch))
    assert sorted(t.batch_id for t in plan.turns) == list(range(len(items)))
    for turn in plan.turns:
        step = items[turn.batch_id][1]
        assert turn.quota_s >= step  # at least one step
        assert turn.quota_s <= max(4.0, step) + 1e-9
    clamped = any(t.quota_s <= items[t.batch_id][1] for t in plan.turns)
    if len({m for m, _ in items}) > 1 and switch > 0 and not clamped:
        # Each batch earns 1/alpha of the tokens its deadlines need per round.
        for turn in plan.turns:
            earned = turn.quota_s / items[turn.batch_id][1]
            needed = plan.round_s / 0.1
            assert earned / needed == pytest.approx(1 / plan.alpha, rel=1e-6)


def test_plan_work_list_estimates_steps_from_contexts() -> None:
    specs = [ModelSpec(m, 64, 128, 1, 2_000_000_000, 1) for m in "ab"]
    lat = LatencyModel(specs, pcie_bytes_per_s=1e9, switch_beta=0.5)  # 1 s switches
    width = specs[0].layer_width
    lat.set_decode_coefficients("*", [0.02 / width, 1e-5 / (3 * 64)])  # 20 ms + 10 us/token
    wl = DecodeWorkList()
    for i, (model, bid) in enumerate([("a", 0), ("b", 1), ("a", 2)]):
        wl.add(Request(f"r{i}", model, 0.0, 100, 100), bid)
    plan = RoundRobinPlanner(tbt_s=0.1, q_max_s=4.0).plan_work_list(wl, lat, lambda rid: 1000)
    assert [t.batch_id for t in plan.turns] == [0, 2, 1]  # regrouped
    assert [b.batch_id for b in wl] == [0, 2, 1]  # in place, too
    assert plan.switch_s == 2.0
    # every batch: 20 ms + 1000 tokens * 10 us = 30 ms -> n = 10/3, equal quotas
    quotas = {t.quota_s for t in plan.turns}
    assert len(quotas) == 1 and quotas.pop() == pytest.approx(4.0)
