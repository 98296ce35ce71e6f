"""The request-level baselines over state a store holds (as ``aegaeon_sched.shared`` is
Algorithms 1-2's).

A baseline (``request-level*``, ``static-mux``) binds each request to a unified
instance at arrival and keeps one global picture: which model each instance
runs, what it runs, what waits (in one global queue, or bound to an instance's
own). That picture is plain data here (lists, dicts, numbers, str: any codec
carries it), and one decision is: build the configured policy
(``aegaeon_sched.make_policy``), :func:`restore` the picture into it, run the
event (arrival, end, cancel), and write back :func:`snapshot`. The caller does
that inside one store transaction, so a decision commits only on the picture it
read. What is not state is rebuilt with the policy every time: the instances,
their KV room (``learn``), static multiplexing's placement.

Everything here is pure (no clock, no I/O).
"""

from __future__ import annotations

from typing import Any

from aegaeon_sched.actions import Policy

__all__ = ["restore", "snapshot"]

BaselineState = dict[str, Any]


def snapshot(policy: Policy) -> BaselineState:
    """The picture ``policy`` holds, as plain data (:func:`restore` takes it back);
    ``TypeError`` for a policy that keeps none (Aegaeon's: its queues are the
    instances' own, ``aegaeon_sched.shared``)."""
    return {"policy": policy.name, **policy.state()}


def restore(policy: Policy, state: BaselineState | None) -> Policy:
    """``policy`` (freshly built, with its instances and their KV room) holding the
    picture ``state`` (None: none yet); an instance the state names that the policy does
    not have is dropped with what it held (its requests end or are dispatched again by
    their proxy, which saw it leave). Raises ``ValueError`` for another policy's state."""
    if state is None:
        return policy
    if state.get("policy") != policy.name:
        raise ValueError(f"the store holds {state.get('policy')!r}'s state, not {policy.name!r}'s")
    policy.restore_state(state)
    return policy
