"""Algorithm 1: grouped FCFS prefill dispatch, driven by invented results."""

from __future__ import annotations

import pytest
from aegaeon_sched import LatencyModel, PrefillDispatcher, PrefillQueue, Request
from sched_support import tiny_latency


def _latency(switch: dict[str, float] | None = None) -> LatencyModel:
    """Prefill of a prompt = 1 ms per token; switch = given seconds per model."""
    return tiny_latency(switch or {"a": 1.0, "b": 1.0, "c": 1.0})


def _req(i: int, model: str, prompt: int = 100, at: float = 0.0) -> Request:
    return Request(f"r{i}", model, at, prompt, 10)


def test_new_group_goes_to_least_loaded_then_open_groups_are_joined_across_instances() -> None:
    d = PrefillDispatcher(["p0", "p1"], _latency())
    inst0, g0 = d.dispatch(_req(0, "a"), 0.0)
    inst1, g1 = d.dispatch(_req(1, "b"), 0.0)
    assert (inst0, inst1) == ("p0", "p1")  # p1 is empty, p0 has work
    assert g0 != g1
    # A request of model b joins b's open group on p1, although p0 is scanned first.
    inst2, g2 = d.dispatch(_req(2, "b"), 0.0)
    assert (inst2, g2) == ("p1", g1)


def test_max_gpsize_counts_every_request_ever_added() -> None:
    d = PrefillDispatcher(["p0"], _latency(), max_group_size=3)
    _, g = d.dispatch(_req(0, "a"), 0.0)
    for i in (1, 2):
        assert d.dispatch(_req(i, "a"), 0.0)[1] == g
    # Executing requests does not reopen the group.
    job = d.next_job("p0", 0.0)
    assert job is not None and job.request.request_id == "r0"
    d.on_done("p0", "r0", 0.1)
    _, g_next = d.dispatch(_req(3, "a"), 0.2)
    assert g_next != g
    groups = list(d.queues["p0"])
    assert [grp.group_id for grp in groups] == [g, g_next]
    assert groups[0].num_added == 3 and len(groups[0].pending) == 2


def test_load_counts_a_switch_at_each_model_change() -> None:
    lat = _latency({"a": 1.0, "b": 2.0, "c": 4.0})
    q = PrefillQueue()
    q.loaded_model = "a"
    q.add(_req(0, "a", 100), 0)  # no switch: a is loaded
    q.add(_req(1, "b", 200), 1)  # switch to b: 2 s
    q.add(_req(2, "a", 300), 2)  # back to a: 1 s
    assert q.load_s(lat, 0.0) == pytest.approx(0.1 + 2.0 + 0.2 + 1.0 + 0.3)
    q.loaded_model = "c"
    assert q.load_s(lat, 0.0) == pytest.approx(1.0 + 0.1 + 2.0 + 0.2 + 1.0 + 0.3)


def test_least_loaded_choice_accounts_for_switches() -> None:
    # p0 holds 3 short requests of the loaded model (0.3 s, no switch); p1
    # holds one short request of a model it must switch to (1 s + 0.1 s).
    d = PrefillDispatcher(["p0", "p1"], _latency())
    d.queues["p0"].loaded_model = "a"
    d.queues["p1"].loaded_model = "a"
    d.dispatch(_req(0, "a"), 0.0)  # -> p0 (tie, first)
    d.queues["p0"].max_group_size = 1  # force separate groups for the next ones
    d.dispatch(_req(1, "b"), 0.0)  # p0 load 0.1, p1 0 -> p1, switch b
    d.queues["p1"].max_group_size = 1
    d.dispatch(_req(2, "a"), 0.0)  # p0: 0.1 ; p1: 1.0 + 0.1 -> p0
    d.dispatch(_req(3, "a"), 0.0)  # p0: 0.2 ; p1: 1.1 -> p0
    assert d.instance_of("r2") == "p0" and d.instance_of("r3") == "p0"
    assert d.queues["p0"].load_s(d.latency, 0.0) == pytest.approx(0.3)
    assert d.queues["p1"].load_s(d.latency, 0.0) == pytest.approx(1.1)
    # A new model c: p0 = 0.3 + switch 1 ; p1 = 1.1 + 1  -> p0
    assert d.dispatch(_req(4, "c"), 0.0)[0] == "p0"


def test_fcfs_order_one_at_a_time_and_groups_vanish() -> None:
    d = PrefillDispatcher(["p0"], _latency())
    for i, m in enumerate("abab"):
        d.dispatch(_req(i, m, at=float(i)), float(i))
    # Groups: a=[r0, r2], b=[r1, r3]; the front group runs to completion first.
    order = []
    now = 10.0
    while (job := d.next_job("p0", now)) is not None:
        assert d.next_job("p0", now) is None  # one request at a time
        order.append((job.request.request_id, job.needs_switch))
        d.on_done("p0", job.request.request_id, now)
        now += 1.0
    assert order == [("r0", True), ("r2", False), ("r1", True), ("r3", False)]
    assert list(d.queues["p0"]) == []


def test_a_start_after_a_lost_finish_takes_the_one_that_ran_out() -> None:
    """Only one request runs at a time: a start while another runs means that one's
    finish was lost; it ran, so it leaves the queue whole (in its group or another)."""
    q = PrefillQueue()
    for i, (m, gid) in enumerate([("a", 1), ("a", 1), ("b", 2)]):
        q.add(_req(i, m), gid)
    q.start("r0", 0.0)
    q.start("r1", 1.0)  # r0's finish was lost (same group)
    assert "r0" not in q and len(q) == 2 and q.running() == _req(1, "a")
    q.start("r2", 2.0)  # r1's (the group empties and goes)
    assert "r1" not in q and len(q) == 1 and [g.group_id for g in q] == [2]
    assert q.done("r1", 3.0) is None and q.done("r2", 3.0) == _req(2, "b") and len(q) == 0


def test_cancel_removes_wherever_the_request_is() -> None:
    d = PrefillDispatcher(["p0", "p1"], _latency())
    d.dispatch(_req(0, "a"), 0.0)
    d.dispatch(_req(1, "b"), 0.0)
    assert d.cancel("r1") == "p1"
    assert list(d.queues["p1"]) == []  # the emptied group vanished
    job = d.next_job("p0", 0.0)
    assert job is not None
    assert d.cancel("r0") == "p0"  # even while running
    assert list(d.queues["p0"]) == []
    assert d.cancel("r0") is None


def test_mirror_queue_matches_the_dispatcher_view() -> None:
    d = PrefillDispatcher(["p0"], _latency())
    mirror = PrefillQueue()
    for i, m in enumerate("aabca"):
        _, gid = d.dispatch(_req(i, m), 0.0)
        mirror.add(_req(i, m), gid)

    def shape(q: PrefillQueue) -> list[tuple[int, str, list[str]]]:
        return [(g.group_id, g.model, [r.request_id for r in g.pending]) for g in q]

    assert shape(mirror) == shape(d.queues["p0"])
    # The instance executes from its mirror and reports; the views stay equal.
    head = mirror.peek()
    assert head is not None
    rid = head[1].request_id
    mirror.start(rid, 1.0)
    d.on_started("p0", rid, 1.0)
    mirror.finish(rid)
    d.on_done("p0", rid, 1.5)
    assert shape(mirror) == shape(d.queues["p0"])
