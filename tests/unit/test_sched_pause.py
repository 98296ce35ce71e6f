"""Paused instances (draining, restarting) take no new work; what waits goes out on resume."""

from __future__ import annotations

from aegaeon_sched import (
    AegaeonPolicy,
    EnqueuePrefill,
    LatencyModel,
    ModelSpec,
    PlaceDecode,
    Request,
)


def _policy() -> AegaeonPolicy:
    specs = [ModelSpec(m, 64, 128, 1, 1_000_000_000, 1) for m in "ab"]
    lat = LatencyModel(specs, pcie_bytes_per_s=1e9)
    width = specs[0].layer_width
    lat.set_prefill_coefficients("*", [1e-4 / width, 0.0, 0.001])
    lat.set_decode_coefficients("*", [0.01 / width, 0.0])
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
