"""Shedding by class under overload, and token velocity: pure, times passed in."""

from __future__ import annotations

import pytest
from aegaeon_sched import Request, Shedder, SLOClasses, Velocity, Verdict, cluster_velocity

CLASSES = SLOClasses.default(ttft_s=2.0, tbt_s=0.1)


def _req(rid: str, cls: str, at: float = 0.0) -> Request:
    c = CLASSES.get(cls)
    return Request(rid, "m", at, 100, 10, priority=c.rank, ttft_s=c.ttft_s, tbt_s=c.tbt_s)


class Node:
    """A node whose admission holds ``held`` of a bound of 100 units; a request asks 10."""

    def __init__(self, held: float) -> None:
        self.held = held

    def fits(self, request: Request, fraction: float) -> bool:
        return self.held + 10 <= 100 * fraction

    def fits_and_admit(self, request: Request, fraction: float) -> bool:
        """``fits``, and if so holds the request's 10 units (as a release admits it)."""
        ok = self.fits(request, fraction)
        self.held += 10 if ok else 0
        return ok


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (30, {"interactive": Verdict.ADMIT, "standard": Verdict.ADMIT, "batch": Verdict.ADMIT}),
        (60, {"interactive": Verdict.ADMIT, "standard": Verdict.ADMIT, "batch": Verdict.DEFER}),
        (95, {"interactive": Verdict.ADMIT, "standard": Verdict.REFUSE, "batch": Verdict.DEFER}),
        (130, {"interactive": Verdict.REFUSE, "standard": Verdict.REFUSE,
               "batch": Verdict.DEFER}),
    ],
)  # fmt: skip
def test_the_lowest_class_is_shed_first_and_the_highest_last(
    held: float, expected: dict[str, Verdict]
) -> None:
    node = Node(held)
    for cls, verdict in expected.items():
        shedder = Shedder(CLASSES)
        assert shedder.decide(_req("r", cls), node.fits) is verdict, cls


def test_deferred_requests_leave_earliest_deadline_first_when_room_is_freed() -> None:
    shedder = Shedder(CLASSES)
    node = Node(60)
    explicit = Request("tight", "m", 1.0, 100, 10, priority=2, ttft_s=1.0)  # due at 2
    for r in (_req("b0", "batch", 0.0), _req("b1", "batch", 0.5), explicit):
        assert shedder.decide(r, node.fits) is Verdict.DEFER
    assert len(shedder) == 3
    assert shedder.release(node.fits) == []  # still no room under 50%
    node.held = 30  # 30 + 10 <= 50: under half the bound again
    first = shedder.release(node.fits)
    assert [r.request_id for r in first] == ["tight", "b0", "b1"]  # (this node never fills)
    assert len(shedder) == 0


def test_a_deferrable_request_never_overtakes_those_waiting() -> None:
    shedder = Shedder(CLASSES)
    node = Node(60)
    assert shedder.decide(_req("b0", "batch"), node.fits) is Verdict.DEFER
    node.held = 0  # room now, but b0 waits until the next release
    assert shedder.decide(_req("b1", "batch"), node.fits) is Verdict.DEFER
    # Other classes are not held behind deferred batch work.
    assert shedder.decide(_req("s0", "standard"), node.fits) is Verdict.ADMIT
    assert [r.request_id for r in shedder.release(node.fits)] == ["b0", "b1"]


def test_a_full_deferral_queue_refuses_and_a_cancel_leaves_it() -> None:
    shedder = Shedder(CLASSES, max_deferred=1)
    node = Node(60)
    assert shedder.decide(_req("b0", "batch"), node.fits) is Verdict.DEFER
    assert shedder.decide(_req("b1", "batch"), node.fits) is Verdict.REFUSE
    assert shedder.refused["batch"] == 1
    assert shedder.cancel("b0") and "b0" not in shedder
    node.held = 0
    assert shedder.release(node.fits) == []
    assert not shedder.cancel("b0")


def test_velocity_is_tokens_per_second_over_its_window() -> None:
    v = Velocity(window_s=2.0)
    assert v.rate(0.0) == 0.0
    v.add(0.0, 100)
    v.add(1.0, 300)
    assert v.rate(1.5) == pytest.approx(200.0)
    assert v.rate(2.5) == pytest.approx(150.0)  # the first burst left the window
    assert v.rate(10.0) == 0.0 and v.total == 400


def test_the_clusters_velocity_sums_its_instances() -> None:
    reports = [{"arrival": 10.0, "prefill": 8.0, "decode": 3.0}, {"arrival": 5.0, "decode": 1.0}]
    assert cluster_velocity(reports) == {"arrival": 15.0, "prefill": 8.0, "decode": 4.0}


def test_with_classes_off_requests_wait_their_turn_until_their_first_token_deadline() -> None:
    shed = Shedder.one_class(ttft_s=10.0, tbt_s=0.1, max_deferred=2)
    full, room = Node(100), Node(0)
    plain = [Request(f"r{i}", "m", float(i), 100, 10) for i in range(4)]  # no own targets
    assert shed.decide(plain[0], room.fits) is Verdict.ADMIT
    # past the bounds: the next ones wait (not a 429 at once), up to max_deferred
    assert [shed.decide(r, full.fits) for r in plain[1:]] == [
        Verdict.DEFER, Verdict.DEFER, Verdict.REFUSE]
    assert shed.next_expiry_s() == 11.0  # r1 arrived at 1 s, TTFT 10 s (the class's)
    # room for one: the earliest leaves first, the other keeps waiting
    assert [r.request_id for r in shed.release(Node(85).fits_and_admit)] == ["r1"]
    assert shed.expire(11.9) == []  # r2 may still meet its TTFT
    assert [r.request_id for r in shed.expire(12.0)] == ["r2"]  # it cannot any more
    assert len(shed) == 0 and shed.next_expiry_s() is None
    assert shed.refused == {"default": 2}  # r3 at once, r2 at its deadline


def test_a_request_cancelled_while_it_waits_never_expires() -> None:
    shed = Shedder.one_class(ttft_s=1.0, tbt_s=0.1)
    shed.decide(Request("a", "m", 0.0, 100, 10), Node(100).fits)
    assert shed.cancel("a")
    assert shed.next_expiry_s() is None and shed.expire(5.0) == []


def test_with_wait_all_every_class_waits_and_room_goes_to_the_highest_first() -> None:
    shed = Shedder(CLASSES, wait_all=True)
    full = Node(200)
    late_batch = _req("b", "batch", at=0.0)  # deadline 10 s
    std = _req("s", "standard", at=1.0)  # deadline 3 s
    urgent = _req("i", "interactive", at=2.0)  # deadline 3 s
    assert [shed.decide(r, full.fits) for r in (late_batch, std, urgent)] == [Verdict.DEFER] * 3
    node = Node(80)  # room for two requests of 10 under the whole bound
    assert [r.request_id for r in shed.release(node.fits_and_admit)] == ["i", "s"]
    assert shed.next_expiry_s() == 10.0 and shed.expire(9.9) == []
    assert [r.request_id for r in shed.expire(10.0)] == ["b"]
    assert shed.refused == {"interactive": 0, "standard": 0, "batch": 1}


def test_max_wait_holds_a_waiter_past_its_deadline_in_arrival_order() -> None:
    shed = Shedder.one_class(ttft_s=10.0, tbt_s=0.1, max_wait_s=30.0)
    full = Node(100)
    # r1 asks a tighter TTFT than r0's; both wait 30 s from their arrival, and once late
    # (past their deadlines), first come first
    r0 = Request("r0", "m", 0.0, 100, 10)
    r1 = Request("r1", "m", 1.0, 100, 10, ttft_s=2.0)
    assert [shed.decide(r, full.fits) for r in (r0, r1)] == [Verdict.DEFER, Verdict.DEFER]
    assert shed.next_expiry_s() == 3.0  # r1 turns late then
    assert shed.expire(12.0) == []  # past both first-token deadlines, still waiting
    assert shed.next_expiry_s() == 30.0
    room = iter([True, False])  # room for one
    assert [r.request_id for r in shed.release(lambda r, f: next(room))] == ["r0"]
    assert [r.request_id for r in shed.expire(31.0)] == ["r1"]
    with pytest.raises(ValueError, match="max_wait_s"):
        Shedder.one_class(ttft_s=10.0, tbt_s=0.1, max_wait_s=0.0)


def test_late_waiters_get_room_only_after_every_on_time_one() -> None:
    shed = Shedder(SLOClasses.default(ttft_s=10.0, tbt_s=0.1), wait_all=True, max_wait_s=60.0)
    full = Node(130)  # past every class's share
    late = Request("late", "m", 0.0, 100, 10, priority=0)  # interactive: TTFT 5 s
    batch = Request("batch", "m", 6.0, 100, 10, priority=2)  # batch, on time until 56 s
    fresh = Request("fresh", "m", 7.0, 100, 10, priority=0)
    assert [shed.decide(r, full.fits) for r in (late, batch)] == [Verdict.DEFER] * 2
    assert shed.expire(6.5) == []  # "late" missed its deadline: it waits on, late
    # an on-time arrival of the late one's class does not queue behind it
    assert shed.decide(fresh, lambda r, f: True) == Verdict.ADMIT
    assert [r.request_id for r in shed.release(lambda r, f: True)] == ["batch", "late"]
    assert shed.decide(Request("x", "m", 8.0, 100, 10), full.fits) == Verdict.DEFER
    assert shed.expire(100.0)[0].request_id == "x" and len(shed) == 0
    assert shed.refused["standard"] == 1 and shed.refused["interactive"] == 0


def test_without_max_wait_a_waiter_is_refused_at_its_deadline() -> None:
    shed = Shedder.one_class(ttft_s=10.0, tbt_s=0.1)
    r0 = Request("r0", "m", 0.0, 100, 10)
    assert shed.decide(r0, Node(100).fits) == Verdict.DEFER
    assert shed.next_expiry_s() == 10.0 and shed.expire(9.9) == []
    assert [r.request_id for r in shed.expire(10.0)] == ["r0"] and len(shed) == 0
