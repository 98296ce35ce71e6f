"""The request-level baselines over store state (``aegaeon_sched.shared_baselines``):
a policy rebuilt from the state a store holds (through msgpack) decides as the live one
does, event for event."""

from __future__ import annotations

import random

import msgspec
import pytest
from aegaeon_sched import ClusterSpec, PolicyOptions, Request, make_policy
from aegaeon_sched.actions import Action, Policy
from aegaeon_sched.shared_baselines import restore, snapshot
from fake_worker import latency_model

BASELINES = ("request-level", "request-level-sjf", "request-level-global",
             "request-level-global-sjf", "request-level-charged", "static-mux")  # fmt: skip
MODELS = ["a", "b", "c"]
INSTANCES = ("decode-0", "decode-1")


def _build(name: str) -> Policy:
    cluster = ClusterSpec(prefill_instances=(), decode_instances=INSTANCES)
    options = PolicyOptions(max_batch_size=3, unified_capacity_tokens=dict.fromkeys(MODELS, 400))
    return make_policy(name, cluster, latency_model(MODELS), options)


def _apply(policy: Policy, event: str, arg: object, now_s: float) -> list[Action]:
    if event == "arrive":
        assert isinstance(arg, Request)
        return policy.on_arrival(arg, now_s)
    if event == "finish":
        return policy.on_request_finished(str(arg), now_s)
    return policy.on_request_cancelled(str(arg), now_s)


def _through_store(name: str, raw: bytes | None, event: str, arg: object,
                   now_s: float) -> tuple[bytes, list[Action]]:  # fmt: skip
    policy = restore(_build(name), None if raw is None else msgspec.msgpack.decode(raw))
    actions = _apply(policy, event, arg, now_s)
    return msgspec.msgpack.encode(snapshot(policy)), actions


@pytest.mark.parametrize("name", BASELINES)
def test_the_store_state_decides_as_the_live_policy(name: str) -> None:
    rng = random.Random(f"{name}-7")
    live = _build(name)
    raw: bytes | None = None
    open_ids: list[str] = []
    for step in range(300):
        now = float(step)
        if open_ids and rng.random() < 0.45:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            event: str = rng.choice(["finish", "cancel"])
            arg: object = rid
        else:
            rid = f"r{step}"
            open_ids.append(rid)
            event, arg = "arrive", Request(rid, rng.choice(MODELS), now, rng.randint(1, 200),
                                           rng.randint(1, 150), rng.randint(1, 150))  # fmt: skip
        want = _apply(live, event, arg, now)
        raw, got = _through_store(name, raw, event, arg, now)
        assert got == want, (step, event, arg)
        assert msgspec.msgpack.decode(raw) == msgspec.msgpack.decode(
            msgspec.msgpack.encode(snapshot(live)))


def test_another_policys_state_is_refused() -> None:
    state = snapshot(_build("request-level"))
    with pytest.raises(ValueError, match="request-level"):
        restore(_build("request-level-global"), state)
