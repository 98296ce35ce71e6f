"""ServerlessLLM as the paper evaluated it: request-level auto-scaling with
requests bound to an instance at arrival.

``"request-level"`` (ServerlessLLM) and ``"request-level-sjf"``
(ServerlessLLM+). The paper's artifact simulated both baselines this way
(25SOSP-Aegaeon, ``aegaeon/sim/scheduler.py``: ``SeLLMPolicy`` and
``SeLLMPlusPolicy`` append each new request to one worker's queue at arrival
and never move it). They differ from :class:`RequestLevelPolicy` (the
idealised global queue, ``"request-level-global"``) in one respect: a request
that can start nowhere at once is bound, at arrival, to one instance's own
queue instead of a global one, and waits there even if another instance goes
idle earlier. That is head-of-line blocking in its plain form.

Binding (at arrival): an instance with no bound requests that serves the
model and has room takes it at once (the least occupied), else an idle one
(an empty instance first, then the least recently used), else the request is
bound to an instance whose queue will batch it with a request of the same
model (FCFS: the queue's tail is that model; SJF: the queue holds that model),
else to the instance with the shortest queue (least recently used on ties).
The artifact binds a new model to the least recently used worker whatever
its queue; the shortest queue never waits longer, so this is no weaker.

Serving (when the instance drains): FCFS takes the queue's head, switches to
its model and runs it with the head's same-model successors that fit.
ServerlessLLM+ takes the request with the shortest oracle output (ties:
arrival) and every queued request of its model that fits, shortest first.
When a request ends on a busy instance, queued requests of the instance's
model that fit join (FCFS: only from the head). SJF here reorders the queue
of requests not started yet; the artifact's ServerlessLLM+ also re-sorts
running batches at every arrival (preempting them with recomputation, which
the paper blames for its "overly frequent auto-scaling" at 0.5 RPS); a
running batch here always completes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from aegaeon_sched.actions import Action
from aegaeon_sched.request import InstanceId, Request
from aegaeon_sched.request_level import RequestLevelPolicy


class PinnedRequestLevelPolicy(RequestLevelPolicy):
    """Policies ``"request-level"`` and ``"request-level-sjf"`` (see the module docstring)."""

    def __init__(
        self,
        instances: Sequence[InstanceId],
        *,
        sjf: bool = False,
        max_batch_size: int = 256,
        capacity_tokens: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(
            instances, sjf=sjf, max_batch_size=max_batch_size, capacity_tokens=capacity_tokens
        )
        self.name = "request-level-sjf" if sjf else "request-level"
        # Each instance's bound requests, in arrival order.
        self.pinned: dict[InstanceId, list[Request]] = {i: [] for i in instances}
        self._pinned_at: dict[str, InstanceId] = {}

    def _batches_with(self, queue: list[Request], model: str) -> bool:
        if self.sjf:
            return any(r.switch_unit == model for r in queue)
        return bool(queue) and queue[-1].switch_unit == model

    def on_arrival(self, request: Request, now_s: float) -> list[Action]:
        free = {i: s for i, s in self.instances.items() if not self.pinned[i]}
        started = self._start(free, request, now_s)
        if started:
            return started
        batching = [i for i, q in self.pinned.items()
                    if self._batches_with(q, request.switch_unit)]
        target = min(
            batching or self.instances,
            key=lambda i: (len(self.pinned[i]), self.instances[i].last_used_s),
        )
        self.pinned[target].append(request)
        self._pinned_at[request.request_id] = target
        return []

    def _next_batch(self, queue: list[Request], model: str | None) -> list[Request]:
        """Queued requests the instance would run next with ``model``, in order."""
        if not queue:
            return []
        if self.sjf:
            head = min(queue, key=self._key)
            model = model or head.switch_unit
            return sorted((r for r in queue if r.switch_unit == model), key=self._key)
        model = model or queue[0].switch_unit
        run = []
        for r in queue:
            if r.switch_unit != model:
                break
            run.append(r)
        return run

    def _pull_queued(self, instance: InstanceId, now_s: float) -> list[Action]:
        state = self.instances[instance]
        queue = self.pinned[instance]
        candidates = self._next_batch(queue, state.model if state.running else None)
        taken: list[Action] = []
        for request in candidates:
            if not self._fits(state, request):
                break
            queue.remove(request)
            del self._pinned_at[request.request_id]
            taken.append(self._run(instance, request, now_s))
        return taken

    def state(self) -> dict[str, Any]:
        pinned = {n: [msgspec.to_builtins(r) for r in q] for n, q in self.pinned.items()}
        return {**super().state(), "pinned": pinned}

    def restore_state(self, state: dict[str, Any]) -> None:
        super().restore_state(state)
        for name, queue in state.get("pinned", {}).items():
            if name in self.pinned:
                self.pinned[name] = [msgspec.convert(r, Request) for r in queue]
                for request in self.pinned[name]:  # (the decoded ids, not the raw arrays')
                    self._pinned_at[request.request_id] = name

    def _release(self, request_id: str, now_s: float) -> list[Action]:
        instance = self._pinned_at.pop(request_id, None)
        if instance is not None:  # cancelled while bound
            queue = self.pinned[instance]
            self.pinned[instance] = [r for r in queue if r.request_id != request_id]
            return []
        return super()._release(request_id, now_s)
