"""Paused instances (draining, restarting) take no new work; what waits goes out on resume."""

from __future__ import annotations

from aegaeon_sched import (
    AegaeonPolicy,
    EnqueuePrefill,
    PlaceDecode,
    Request,
)
from sched_support import tiny_latency


def _policy() -> AegaeonPolicy:
    lat = tiny_latency("ab", prefill_s=1e-4, prefill_const_s=0.001, decode_s=0.01,
                       switch_beta=0.625)  # fmt: skip
    return AegaeonPolicy(["p0", "p1"], ["d0"], lat)


def _request(rid: str, model: str = "a") -> Request:
    return Request(rid, model, 0.0, 16, 8)


def test_arrivals_avoid_a_paused_prefill_instance_and_wait_when_all_are() -> None:
    policy = _policy()
    policy.pause("p0")
    (action,) = policy.on_arrival(_request("r1"), 0.0)
    assert isinstance(action, EnqueuePrefill) and action.instance == "p1"
    policy.pause("p1")
    assert policy.on_arrival(_request("r2", "b"), 0.0) == []
    assert policy.on_arrival(_request("r3", "b"), 0.0) == []
    policy.on_request_cancelled("r3", 0.0)  # a held request can go away
    actions = policy.resume("p0", 1.0)
    assert [(type(a), a.request.request_id, a.instance) for a in actions] == [  # type: ignore[attr-defined]
        (EnqueuePrefill, "r2", "p0")
    ]
    assert policy.held_arrivals == {}


def test_placements_wait_while_every_decode_instance_is_paused() -> None:
    policy = _policy()
    (enqueue,) = policy.on_arrival(_request("r1"), 0.0)
    assert isinstance(enqueue, EnqueuePrefill)
    policy.pause("d0")
    assert policy.on_prefill_done(enqueue.instance, "r1", 0.01, 0.1) == []
    assert list(policy.held_placements) == ["r1"]
    (place,) = policy.resume("d0", 0.2)
    assert isinstance(place, PlaceDecode) and (place.instance, place.request.request_id) == (
        "d0", "r1"
    )  # fmt: skip
