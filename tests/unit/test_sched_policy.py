"""The Aegaeon policy through the action contract, with instance-side mirrors."""

from __future__ import annotations

from aegaeon_sched import (
    AegaeonPolicy,
    Cancel,
    DecodeWorkList,
    EnqueuePrefill,
    PlaceDecode,
    PrefillQueue,
    Request,
)
from sched_support import tiny_latency


def _policy() -> AegaeonPolicy:
    lat = tiny_latency("ab", prefill_s=1e-4, prefill_const_s=0.001, decode_s=0.01,
                       switch_beta=0.625)  # fmt: skip
    return AegaeonPolicy(["p0", "p1"], ["d0", "d1"], lat)


def _req(i: int, model: str) -> Request:
    return Request(f"r{i}", model, float(i), 100, 50)


def test_request_flows_through_prefill_then_decode_with_mirrors() -> None:
    policy = _policy()
    prefill_mirrors = {i: PrefillQueue() for i in ("p0", "p1")}
    decode_mirrors = {i: DecodeWorkList() for i in ("d0", "d1")}
    for i, m in enumerate("abab"):
        for act in policy.on_arrival(_req(i, m), float(i)):
            assert isinstance(act, EnqueuePrefill)
            prefill_mirrors[act.instance].add(act.request, act.group_id)
    # a's group on p0, b's on p1; the second a and b joined those groups.
    assert [len(q) for q in prefill_mirrors.values()] == [2, 2]
    now = 5.0
    for instance, mirror in prefill_mirrors.items():
        while (head := mirror.peek()) is not None:
            rid = head[1].request_id
            mirror.start(rid, now)
            assert policy.on_prefill_started(instance, rid, now) == []
            now += 0.1
            mirror.finish(rid)
            for act in policy.on_prefill_done(instance, rid, 0.1, now):
                assert isinstance(act, PlaceDecode)
                decode_mirrors[act.instance].add(act.request, act.batch_id)
    for d_instance, work_list in decode_mirrors.items():
        view = policy.decode.work_lists[d_instance]
        assert [(b.batch_id, list(b.requests)) for b in work_list] == [
            (b.batch_id, list(b.requests)) for b in view
        ]
    # one batch per model, on different decode instances (shortest work list)
    assert sorted(len(wl) for wl in decode_mirrors.values()) == [1, 1]
    assert policy.on_request_finished("r0", now) == []
    assert "r0" not in policy.decode.work_lists["d0"]


def test_cancel_targets_the_instance_holding_the_request() -> None:
    policy = _policy()
    [enq] = policy.on_arrival(_req(0, "a"), 0.0)
    assert isinstance(enq, EnqueuePrefill)
    assert policy.on_request_cancelled("r0", 0.1) == [Cancel(enq.instance, "r0")]
    assert policy.on_prefill_done(enq.instance, "r0", 0.1, 0.2) == []  # late report: ignored
    policy.on_arrival(_req(1, "a"), 1.0)
    job = policy.next_prefill("p0", 1.0)
    assert job is not None and job.needs_switch
    [place] = policy.on_prefill_done("p0", "r1", 0.1, 1.5)
    assert isinstance(place, PlaceDecode)
    assert policy.on_request_cancelled("r1", 2.0) == [Cancel(place.instance, "r1")]
    assert len(policy.decode.work_lists[place.instance]) == 0


def test_a_prefill_action_carries_its_groups_place() -> None:
    """A request joining an open group carries the group's key (the opening request's
    first-token deadline), so a mirror that emptied the group meanwhile reopens it
    in the same place."""
    policy = _policy()
    first, second = (policy.on_arrival(_req(i, "a"), float(i)) for i in (0, 2))
    assert isinstance(first[0], EnqueuePrefill) and isinstance(second[0], EnqueuePrefill)
    assert second[0].group_id == first[0].group_id
    assert second[0].group_key_s == first[0].group_key_s is not None
    mirror = PrefillQueue()  # the instance's, its copy of the group already gone
    mirror.add(_req(1, "b"), 99)
    mirror.add(second[0].request, second[0].group_id, key_s=second[0].group_key_s)
    assert [g.model for g in mirror] == ["a", "b"]
