"""SLO classes in Algorithm 1 and Eq. 2-3: deadline order, no starvation, tightest TBT."""

from __future__ import annotations

import pytest
from aegaeon_sched import (
    BatchLoad,
    DecodeWorkList,
    LatencyModel,
    PrefillDispatcher,
    PrefillQueue,
    Request,
    RoundRobinPlanner,
    SLOClasses,
)
from aegaeon_sched.priority import BATCH, INTERACTIVE, STANDARD
from sched_support import tiny_latency

CLASSES = SLOClasses.default(ttft_s=2.0, tbt_s=0.1)  # interactive 1 s, batch 10 s


def _latency() -> LatencyModel:
    """Prefill = 1 ms per prompt token (a 1000-token prompt: 1 s); switches 0.5 s."""
    return tiny_latency("ab", switch_s=0.5)


def _req(rid: str, at: float, cls: str = "standard", model: str = "a") -> Request:
    """A 1000-token prompt (1 s of prefill) of class ``cls``."""
    c = CLASSES.get(cls)
    return Request(rid, model, at, 1000, 16, priority=c.rank, ttft_s=c.ttft_s, tbt_s=c.tbt_s)


def test_one_class_keeps_the_papers_fifo_of_groups() -> None:
    q = PrefillQueue()
    for i, model in enumerate("abab"):
        q.add(Request(f"r{i}", model, float(i), 10, 4), i)
    assert [g.group_id for g in q] == [0, 1, 2, 3]
    head = q.peek()
    assert head is not None and head[1].request_id == "r0"


def test_an_interactive_group_goes_first_at_the_next_request_boundary() -> None:
    q = PrefillQueue()
    q.add(_req("b0", 0.0, "batch"), 1)
    q.add(_req("b1", 0.1, "batch"), 1)
    q.start("b0", 0.5)
    q.add(_req("i0", 0.6, "interactive"), 2)  # key 1.6 < batch key 10.0
    assert q.peek() is None  # the running batch prefill is never interrupted
    q.finish("b0")
    head = q.peek()
    assert head is not None and head[1].request_id == "i0"
    assert [g.group_id for g in q] == [2, 1]


def test_groups_hold_one_class_so_interactive_never_joins_a_batch_group() -> None:
    d = PrefillDispatcher(["p0"], _latency())
    _, g_batch = d.dispatch(_req("b0", 0.0, "batch"), 0.0)
    _, g_int = d.dispatch(_req("i0", 0.1, "interactive"), 0.1)
    _, g_batch2 = d.dispatch(_req("b1", 0.2, "batch"), 0.2)
    assert g_int != g_batch and g_batch2 == g_batch
    assert [g.priority for g in d.queues["p0"]] == [INTERACTIVE, BATCH]


def test_least_loaded_counts_only_the_work_ahead_of_the_new_group() -> None:
    d = PrefillDispatcher(["p0", "p1"], _latency())
    d.dispatch(_req("s0", 0.0, "standard", model="b"), 0.0)  # p0: 1 s of work due at 2
    for i in range(4):  # p1 (p0 has work ahead of them): 4 s of batch work due at 10
        d.dispatch(_req(f"b{i}", 0.0, "batch", model="a"), 0.0)
    assert d.instance_of("s0") == "p0" and d.instance_of("b3") == "p1"
    # The paper's rule picks p0 (1 s < 4 s); but nothing on p1 runs before an
    # interactive request due at 2.5, while s0 on p0 does.
    instance, _ = d.dispatch(_req("i0", 1.5, "interactive", model="b"), 1.5)
    assert instance == "p1"
    # A batch request lands behind everything: the least loaded queue overall.
    instance, _ = d.dispatch(_req("b9", 1.5, "batch", model="b"), 1.5)
    assert instance == "p0"


def test_the_lowest_class_waits_a_bounded_time_under_an_interactive_flood() -> None:
    """One instance, 1 s per prefill, interactive arrivals every 0.5 s (2x its capacity):
    the batch request that came first still runs once its deadline comes up."""
    d = PrefillDispatcher(["p0"], _latency())
    d.dispatch(_req("i", 0.0, "interactive"), 0.0)
    d.dispatch(_req("batch", 0.0, "batch"), 0.0)
    now, n, started = 0.0, 0, {}
    arrivals = iter(i * 0.5 for i in range(1, 200))
    next_arrival = next(arrivals)
    while "batch" not in started:
        while next_arrival <= now:  # arrivals up to now, in order
            d.dispatch(_req(f"i{n}", next_arrival, "interactive"), next_arrival)
            n += 1
            next_arrival = next(arrivals)
        job = d.next_job("p0", now)
        assert job is not None
        started[job.request.request_id] = now
        now += 1.0
        d.on_done("p0", job.request.request_id, now)
    # Ahead of it ran only interactive requests due before it (arrived by 9 s: 19 of
    # them), those that joined their open groups (at most MAX_GPSIZE - 1 = 7 more) and
    # the one running when it came due: a bound that holds however long the flood lasts.
    assert started["batch"] <= 19 + 7 + 1
    assert n >= 1.9 * started["batch"]  # the flood went on meanwhile, twice as fast as served


def test_the_instance_mirror_runs_what_the_proxy_expects() -> None:
    d = PrefillDispatcher(["p0"], _latency())
    mirror = PrefillQueue()
    reqs = [_req("b0", 0.0, "batch"), _req("s0", 0.2), _req("i0", 0.3, "interactive"),
            _req("b1", 0.4, "batch", "b"), _req("i1", 0.5, "interactive", "b")]  # fmt: skip
    for r in reqs:
        _, group = d.dispatch(r, r.arrival_s)
        mirror.add(r, group)
    order = []
    while (head := mirror.peek()) is not None:
        rid = head[1].request_id
        job = d.next_job("p0", 0.0)
        assert job is not None and job.request.request_id == rid
        mirror.start(rid, 0.0)
        mirror.finish(rid)
        d.on_done("p0", rid, 0.0)
        order.append(rid)
    assert order == ["i0", "i1", "s0", "b0", "b1"]


def test_explicit_ttft_orders_requests_inside_a_group() -> None:
    q = PrefillQueue(default_ttft_s=5.0)
    q.add(Request("late", "a", 0.0, 10, 4), 1)  # due at 5
    q.add(Request("soon", "a", 1.0, 10, 4, ttft_s=1.0), 1)  # due at 2
    head = q.peek()
    assert head is not None and head[1].request_id == "soon"


def test_a_batch_is_planned_for_its_tightest_tbt() -> None:
    work = DecodeWorkList()
    work.add(_req("b0", 0.0, "batch"), 1)
    assert work.batch(1) is not None and work.batch(1).tbt_s == pytest.approx(0.4)  # type: ignore[union-attr]
    work.add(_req("i0", 0.0, "interactive"), 1)
    assert work.batch(1).tbt_s == pytest.approx(0.1)  # type: ignore[union-attr]
    work.remove("i0")
    assert work.batch(1).tbt_s == pytest.approx(0.4)  # type: ignore[union-attr]


def test_quotas_give_every_batch_its_own_tbt_share() -> None:
    planner = RoundRobinPlanner(tbt_s=0.1, q_max_s=4.0)
    loads = [BatchLoad(1, "a", 0.02, tbt_s=0.05), BatchLoad(2, "b", 0.02, tbt_s=0.2)]
    plan = planner.plan(loads, {"a": 0.3, "b": 0.3})
    q = {t.batch_id: t.quota_s for t in plan.turns}
    assert q[1] == pytest.approx(4 * q[2])  # q_i = c t_i / (d_i (alpha - S))
    for turn, d in zip(plan.turns, (0.05, 0.2), strict=True):
        earned = turn.quota_s / 0.02  # tokens in the turn
        due = plan.round_s / d  # tokens the round's deadlines require
        assert earned / due == pytest.approx(1 / plan.alpha)
    # Without per-batch targets both use the planner's: equal quotas.
    same = planner.plan([BatchLoad(1, "a", 0.02), BatchLoad(2, "b", 0.02)], {"a": 0.3, "b": 0.3})
    assert same.turns[0].quota_s == pytest.approx(same.turns[1].quota_s)


def test_standard_requests_are_unchanged_by_the_class_fields() -> None:
    plain = Request("r", "a", 0.0, 10, 4)
    assert plain.priority == STANDARD and plain.ttft_s is None and plain.tbt_s is None
