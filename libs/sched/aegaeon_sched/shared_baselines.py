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

import heapq
import math
from typing import Any

from aegaeon_sched.actions import Policy
from aegaeon_sched.request_level import RequestLevelPolicy
from aegaeon_sched.request_pinned import PinnedRequestLevelPolicy
from aegaeon_sched.shared import request_from_state, request_state
from aegaeon_sched.static_mux import StaticMuxPolicy

__all__ = ["restore", "snapshot"]

BaselineState = dict[str, Any]


def _time(value: float) -> float | None:
    """A time a codec without infinities carries (None: never)."""
    return None if math.isinf(value) else value


def snapshot(policy: Policy) -> BaselineState:
    """The picture ``policy`` holds, as plain data (:func:`restore` takes it back)."""
    if isinstance(policy, StaticMuxPolicy):
        return {"policy": policy.name, "bound": dict(policy._instance_of)}
    if not isinstance(policy, RequestLevelPolicy):
        raise TypeError(f"policy {policy.name!r} keeps no baseline state")
    instances = {
        name: [s.model, [request_state(r) for r in s.running.values()], s.reserved_tokens,
               _time(s.last_used_s)]
        for name, s in policy.instances.items()
    }  # fmt: skip
    queued = [[list(key), seq, request_state(r)] for heap in policy._queues.values()
              for key, seq, r in heap if r.request_id in policy._queued_ids]  # fmt: skip
    out: BaselineState = {"policy": policy.name, "instances": instances,
                          "queued": sorted(queued), "seq": policy._seq}  # fmt: skip
    if isinstance(policy, PinnedRequestLevelPolicy):
        out["pinned"] = {n: [request_state(r) for r in q] for n, q in policy.pinned.items()}
    return out


def restore(policy: Policy, state: BaselineState | None) -> Policy:
    """``policy`` (freshly built, with its instances and their KV room) holding the
    picture ``state`` (None: none yet); an instance the state names that the policy does
    not have is dropped with what it held (its requests end or are dispatched again by
    their proxy, which saw it leave). Raises ``ValueError`` for another policy's state."""
    if state is None:
        return policy
    if state.get("policy") != policy.name:
        raise ValueError(f"the store holds {state.get('policy')!r}'s state, not {policy.name!r}'s")
    if isinstance(policy, StaticMuxPolicy):
        policy._instance_of = {str(k): str(v) for k, v in state["bound"].items()}
        return policy
    if not isinstance(policy, RequestLevelPolicy):
        raise TypeError(f"policy {policy.name!r} keeps no baseline state")
    for name, (model, running, reserved, last_used) in state["instances"].items():
        unified = policy.instances.get(name)
        if unified is None:
            continue
        requests = [request_from_state(r) for r in running]
        unified.model = model
        unified.running = {r.request_id: r for r in requests}
        unified.reserved_tokens = int(reserved)
        unified.last_used_s = -math.inf if last_used is None else float(last_used)
        for request in requests:
            policy._instance_of[request.request_id] = name
    for key, seq, raw in state["queued"]:
        request = request_from_state(raw)
        heap = policy._queues.setdefault(request.switch_unit, [])
        heapq.heappush(heap, ((float(key[0]), float(key[1])), int(seq), request))
        policy._queued_ids.add(request.request_id)
    policy._seq = int(state["seq"])
    if isinstance(policy, PinnedRequestLevelPolicy):
        for name, queue in state.get("pinned", {}).items():
            if name not in policy.pinned:
                continue
            policy.pinned[name] = [request_from_state(r) for r in queue]
            for raw in queue:
                policy._pinned_at[str(raw[0])] = name
    return policy

