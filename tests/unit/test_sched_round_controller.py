"""The round controller's rules (aegaeon_sched.rounds.RoundController): pure, time passed in."""

from __future__ import annotations

import pytest
from aegaeon_sched import (
    DecodeShare,
    DecodeWorkList,
    LatencyModel,
    ModelSpec,
    Request,
    RoundController,
    RoundRobinPlanner,
    TurnEnd,
)

MODELS = ("a", "b", "c")


def _latency() -> LatencyModel:
    lat = LatencyModel(
        [ModelSpec(m, 64, 128, 2, 1 << 20, 256) for m in MODELS], pcie_bytes_per_s=1 << 24
    )
    for m in MODELS:
        lat.set_decode_coefficients(m, (1e-7, 1e-10))
    return lat


LAT = _latency()


def _work(*batches: tuple[int, str]) -> DecodeWorkList:
    work = DecodeWorkList()
    for batch_id, model in batches:
        _add(work, batch_id, model)
    return work


def _add(work: DecodeWorkList, batch_id: int, model: str, rid: str | None = None) -> str:
    rid = rid or f"{model}{batch_id}-{work.num_requests}"
    work.add(Request(rid, model, 0.0, 100, 50), batch_id)
    return rid


def _plan(ctl: RoundController, work: DecodeWorkList, now_s: float = 0.0, busy_s: float = 0.0):
    return ctl.plan_round(work, LAT, lambda rid: 120, LAT.switch_s, now_s=now_s,
                          prefill_busy_s=busy_s)  # fmt: skip


def _turns(ctl: RoundController, work: DecodeWorkList) -> list[int]:
    ids = []
    while (turn := ctl.next_turn(work)) is not None:
        ids.append(turn.batch_id)
    return ids


def test_plans_with_the_planner_grouped_by_model() -> None:
    work = _work((0, "a"), (1, "b"), (2, "a"))
    planner = RoundRobinPlanner(0.1, 4.0, ttft_s=2.0)
    plan = _plan(RoundController(planner), work)
    assert [t.batch_id for t in plan.turns] == [0, 2, 1]
    assert [b.batch_id for b in work] == [0, 2, 1]  # the work list regrouped in place
    same = RoundRobinPlanner(0.1, 4.0, ttft_s=2.0).plan_work_list(work, LAT, lambda rid: 120)
    assert plan.turns == same.turns and plan.switch_s > 0


def test_runs_every_planned_turn_and_skips_emptied_batches() -> None:
    work = _work((0, "a"), (1, "b"), (2, "c"))
    ctl = RoundController(RoundRobinPlanner(0.1, 4.0))
    _plan(ctl, work)
    assert ctl.next_turn(work).batch_id == 0  # type: ignore[union-attr]
    (rid,) = work.batch(1).requests  # type: ignore[union-attr]
    work.remove(rid)  # batch 1 empties before its turn
    assert ctl.next_turn(work).batch_id == 2  # type: ignore[union-attr]
    assert ctl.next_turn(work) is None  # the round ran to its end
    assert ctl.next_turn(work) is None  # and stays over until the next plan


def test_quota_runs_from_the_switch_and_ends_the_turn() -> None:
    work = _work((0, "a"), (1, "b"))
    ctl = RoundController(RoundRobinPlanner(0.1, 4.0))
    plan = _plan(ctl, work)
    ctl.next_turn(work)
    end = ctl.start_quota(10.0)  # the model is in place at t = 10
    assert end == pytest.approx(10.0 + plan.turns[0].quota_s)
    assert ctl.turn_over(work, end - 1e-6) is None
    assert ctl.turn_over(work, end) is TurnEnd.QUOTA
    for rid in list(work.batch(0).requests):  # type: ignore[union-attr]
        work.remove(rid)
    assert ctl.turn_over(work, 10.0) is TurnEnd.EMPTIED


def test_a_one_model_round_is_cut_by_a_batch_it_did_not_plan_for() -> None:
    work = _work((0, "a"), (1, "a"))
    ctl = RoundController(RoundRobinPlanner(0.1, 4.0))
    assert _plan(ctl, work).switch_s == 0
    ctl.next_turn(work)
    ctl.start_quota(0.0)
    assert ctl.turn_over(work, 0.5) is None
    # Batch 1 leaves and batch 2 (another model) arrives: the number of batches is
    # the same, the round did not plan for batch 2: the turn ends at once.
    for rid in list(work.batch(1).requests):  # type: ignore[union-attr]
        work.remove(rid)
    _add(work, 2, "b")
    assert ctl.turn_over(work, 0.5) is TurnEnd.CUT
    assert ctl.next_turn(work) is None  # the round is cut: plan again
    replan = _plan(ctl, work)
    assert [t.batch_id for t in replan.turns] == [2, 0]  # batch 0 had its turn: last


def test_a_round_with_switches_runs_on_past_a_new_batch_unless_fresh_first() -> None:
    for fresh_first, expect in ((False, [0, 1]), (True, [0])):  # fresh-first: cut, re-plan
        work = _work((0, "a"), (1, "b"))
        ctl = RoundController(RoundRobinPlanner(0.1, 4.0, fresh_first=fresh_first))
        _plan(ctl, work)
        ran = [ctl.next_turn(work).batch_id]  # type: ignore[union-attr]
        ctl.start_quota(0.0)
        _add(work, 2, "c")
        assert ctl.turn_over(work, 0.0) is None  # never mid-turn in a round with switches
        ran += _turns(ctl, work)
        assert ran == expect
    # the re-plan puts batches that never had a turn first, the served one last
    assert [t.batch_id for t in _plan(ctl, work).turns] == [1, 2, 0]


def test_a_waiting_prefill_preempts_the_turn_and_cuts_the_round() -> None:
    work = _work((0, "a"), (1, "b"), (2, "c"))
    ctl = RoundController(RoundRobinPlanner(0.1, 4.0), share=DecodeShare())
    _plan(ctl, work)
    ctl.next_turn(work)
    ctl.start_quota(0.0)
    assert ctl.turn_over(work, 0.01, prefill_waiting=True) is TurnEnd.PREEMPTED
    assert ctl.next_turn(work, prefill_waiting=True) is None
    # Cut after cut, every batch still gets its turn (ServedInRound).
    firsts = []
    for _ in range(4):
        _plan(ctl, work)
        firsts.append(ctl.next_turn(work).batch_id)  # type: ignore[union-attr]
        assert ctl.next_turn(work, prefill_waiting=True) is None
    assert firsts == [1, 2, 0, 1]


def test_a_hybrid_plans_for_the_share_its_prefills_leave() -> None:
    work = _work((0, "a"), (1, "b"))
    planner = RoundRobinPlanner(0.1, 4.0, ttft_s=2.0)
    idle = RoundController(planner, share=DecodeShare(smoothing=1.0, min_interval_s=0.0))
    busy = RoundController(planner, share=DecodeShare(smoothing=1.0, min_interval_s=0.0))
    _plan(idle, work, 0.0, 0.0)
    _plan(busy, work, 0.0, 0.0)
    quiet = _plan(idle, work, 1.0, 0.0)
    loaded = _plan(busy, work, 1.0, 0.5)  # half of the last second went to prefills
    assert busy.share is not None and busy.share.share == pytest.approx(0.5)
    half = planner.plan_work_list(work, LAT, lambda rid: 120, decode_share=0.5)
    assert loaded.turns == half.turns and loaded.alpha == pytest.approx(half.alpha)
    assert quiet.turns == planner.plan_work_list(work, LAT, lambda rid: 120).turns
    assert loaded.turns != quiet.turns


def test_following_and_prefetch_look_past_the_round() -> None:
    work = _work((0, "a"), (1, "b"), (2, "a"))
    ctl = RoundController(RoundRobinPlanner(0.1, 4.0))
    _plan(ctl, work)  # turns: 0 (a), 2 (a), 1 (b)
    ctl.next_turn(work)
    assert ctl.following(work) == [2, 1, 0]
    assert ctl.prefetch_model(work) == "b"
    (rid,) = work.batch(1).requests  # type: ignore[union-attr]
    work.remove(rid)  # b empties; c arrives: it runs next round, so it is prefetched
    _add(work, 3, "c")
    assert ctl.following(work) == [2, 0, 3]
    assert ctl.prefetch_model(work) == "c"
    ctl.next_turn(work)  # batch 2 (a)
    assert ctl.prefetch_model(work) == "c"
    for rid in list(work.batch(3).requests):  # type: ignore[union-attr]
        work.remove(rid)
    assert ctl.prefetch_model(work) is None  # nothing but a waits


def test_fresh_first_prefetches_the_batch_that_takes_the_next_turn() -> None:
    work = _work((0, "a"), (1, "b"))
    ctl = RoundController(RoundRobinPlanner(0.1, 4.0, fresh_first=True))
    _plan(ctl, work)
    ctl.next_turn(work)
    _add(work, 3, "c")
    _add(work, 2, "b")
    # The re-plan at the turn's end: batches that never had a turn first (b: 1 and 2,
    # then c: 3), then the one just served.
    assert ctl.following(work) == [1, 2, 3, 0]
    assert ctl.prefetch_model(work) == "b"
    assert ctl.next_turn(work) is None
    assert [t.batch_id for t in _plan(ctl, work).turns] == [1, 2, 3, 0]
