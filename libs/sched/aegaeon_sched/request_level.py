"""Request-level auto-scaling with a global queue (an idealised ServerlessLLM).

``"request-level-global"`` (FCFS) and ``"request-level-global-sjf"`` (oracle
SJF). Stronger than the baselines the paper evaluated
(:mod:`aegaeon_sched.request_pinned`, ``"request-level"``): a waiting request
goes to whichever instance frees up first, so it never waits behind another
instance's backlog. Reported as an extra line.

Instances are unified: each runs the prefill and the decode of the requests
it is given, serves one model at a time and batches every request of that
model it holds, and of its LoRA adapters, as vLLM batches them on a resident
base (continuous batching, up to ``max_batch_size`` and its KV capacity).
Scaling happens only at request boundaries:

- a request for a model loaded on an instance with room joins it (the least
  occupied such instance);
- otherwise an idle instance (no running requests) is scaled to the request's
  model (preferring one with no model loaded, then the least recently used);
- otherwise the request waits in a global queue. When an instance becomes
  idle it scales to the model of the queue's head and takes every queued
  request of that model that fits; when a request ends on a busy instance,
  queued requests of that instance's model that now fit join it.

The head is the earliest arrival (FCFS) or the shortest oracle output length
(SJF). Head-of-line blocking remains: a long request holds its instance, and
a queued request of another model waits until some instance drains.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from aegaeon_sched.actions import Action, Cancel, PolicyBase, RunOnInstance
from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.request import InstanceId, Request


@dataclass
class _Unified:
    model: str | None = None
    running: dict[str, Request] = field(default_factory=dict)
    reserved_tokens: int = 0
    last_used_s: float = float("-inf")


class RequestLevelPolicy(PolicyBase):
    """Policies ``"request-level-global"`` (FCFS) and ``"request-level-global-sjf"``."""

    def __init__(
        self,
        instances: Sequence[InstanceId],
        *,
        sjf: bool = False,
        max_batch_size: int = 256,
        capacity_tokens: Mapping[str, int] | None = None,
    ) -> None:
        if not instances:
            raise ValueError("request-level policies need at least one instance")
        self.name = "request-level-global-sjf" if sjf else "request-level-global"
        self.sjf = sjf
        self.max_batch_size = max_batch_size
        self.capacity_tokens: dict[str, int] = dict(capacity_tokens or {})
        self.instances: dict[InstanceId, _Unified] = {i: _Unified() for i in instances}
        # The global queue, split by model: heaps ordered by the head key, so
        # finding the head and taking a model's requests never scans the queue.
        self._queues: dict[str, list[tuple[tuple[float, float], int, Request]]] = {}
        self._queued_ids: set[str] = set()
        self._seq = 0
        self._instance_of: dict[str, InstanceId] = {}

    # ---- its picture as plain data (a store holds it between events) --------
    def state(self) -> dict[str, Any]:
        instances = {
            name: [s.model, [msgspec.to_builtins(r) for r in s.running.values()],
                   s.reserved_tokens, None if math.isinf(s.last_used_s) else s.last_used_s]
            for name, s in self.instances.items()
        }  # fmt: skip
        queued = [[list(key), seq, msgspec.to_builtins(r)] for heap in self._queues.values()
                  for key, seq, r in heap if r.request_id in self._queued_ids]  # fmt: skip
        return {"instances": instances, "queued": sorted(queued), "seq": self._seq}

    def restore_state(self, state: dict[str, Any]) -> None:
        """An instance the state names that this policy does not have is dropped with
        what it held."""
        for name, (model, running, reserved, last_used) in state["instances"].items():
            unified = self.instances.get(name)
            if unified is None:
                continue
            requests = [msgspec.convert(r, Request) for r in running]
            unified.model = model
            unified.running = {r.request_id: r for r in requests}
            unified.reserved_tokens = int(reserved)
            unified.last_used_s = -math.inf if last_used is None else float(last_used)
            for request in requests:
                self._instance_of[request.request_id] = name
        for key, seq, raw in state["queued"]:
            request = msgspec.convert(raw, Request)
            heap = self._queues.setdefault(request.switch_unit, [])
            heapq.heappush(heap, ((float(key[0]), float(key[1])), int(seq), request))
            self._queued_ids.add(request.request_id)
        self._seq = int(state["seq"])

    # ---- the global queue ----------------------------------------------
    @property
    def queue(self) -> list[Request]:
        """Queued requests, head first."""
        entries = [e for heap in self._queues.values() for e in heap]
        return [e[2] for e in sorted(entries) if e[2].request_id in self._queued_ids]

    def _key(self, request: Request) -> tuple[float, float]:
        if self.sjf:
            return (float(request.oracle_output_len or request.max_tokens), request.arrival_s)
        return (request.arrival_s, 0.0)

    def _enqueue(self, request: Request) -> None:
        heap = self._queues.setdefault(request.switch_unit, [])
        heapq.heappush(heap, (self._key(request), self._seq, request))
        self._seq += 1
        self._queued_ids.add(request.request_id)

    def _peek(self, model: str) -> Request | None:
        heap = self._queues.get(model)
        while heap and heap[0][2].request_id not in self._queued_ids:
            heapq.heappop(heap)  # cancelled while queued
        if not heap:
            self._queues.pop(model, None)
            return None
        return heap[0][2]

    def _head_model(self) -> str | None:
        best: tuple[tuple[float, float], int] | None = None
        best_model = None
        for model in list(self._queues):
            if self._peek(model) is None:
                continue
            key, seq, _ = self._queues[model][0]
            if best is None or (key, seq) < best:
                best, best_model = (key, seq), model
        return best_model

    # ---- helpers -------------------------------------------------------
    def _fits(self, state: _Unified, request: Request) -> bool:
        if not state.running:
            return True  # an empty instance takes any one request
        if len(state.running) >= self.max_batch_size:
            return False
        cap = self.capacity_tokens.get(request.switch_unit)
        return cap is None or state.reserved_tokens + request.kv_tokens <= cap

    def _run(self, instance: InstanceId, request: Request, now_s: float) -> RunOnInstance:
        state = self.instances[instance]
        state.model = request.switch_unit
        state.running[request.request_id] = request
        state.reserved_tokens += request.kv_tokens
        state.last_used_s = now_s
        self._instance_of[request.request_id] = instance
        return RunOnInstance(instance, request, request.switch_unit)

    def _pull_queued(self, instance: InstanceId, now_s: float) -> list[Action]:
        """Fill ``instance`` from the queue with requests of its model, head first.

        An idle instance first scales to the model of the queue's head.
        """
        state = self.instances[instance]
        if not state.running:
            head_model = self._head_model()
            if head_model is not None:
                state.model = head_model
        if state.model is None:
            return []
        taken: list[Action] = []
        while (req := self._peek(state.model)) is not None and self._fits(state, req):
            heapq.heappop(self._queues[state.model])
            self._queued_ids.discard(req.request_id)
            taken.append(self._run(instance, req, now_s))
        return taken

    def _release(self, request_id: str, now_s: float) -> list[Action]:
        instance = self._instance_of.pop(request_id, None)
        if instance is None:
            self._queued_ids.discard(request_id)
            return []
        state = self.instances[instance]
        request = state.running.pop(request_id)
        state.reserved_tokens -= request.kv_tokens
        state.last_used_s = now_s
        return self._pull_queued(instance, now_s)

    # ---- events --------------------------------------------------------
    def _start(
        self, free: Mapping[InstanceId, _Unified], request: Request, now_s: float
    ) -> list[Action]:
        """Run ``request`` at once on one of ``free`` if one can take it: the least busy
        holding its model, else an idle one; ``[]`` if none can."""
        warm = [i for i, s in free.items()
                if s.model == request.switch_unit and self._fits(s, request)]
        if warm:
            return [self._run(min(warm, key=lambda i: len(free[i].running)), request, now_s)]
        idle = [i for i, s in free.items() if not s.running]
        if not idle:
            return []
        # Keep warm models where possible: an empty instance first, then LRU.
        target = min(idle, key=lambda i: (free[i].model is not None, free[i].last_used_s))
        return [self._run(target, request, now_s)]

    def on_arrival(self, request: Request, now_s: float) -> list[Action]:
        started = self._start(self.instances, request, now_s)
        if not started:
            self._enqueue(request)
        return started

    def on_request_finished(self, request_id: str, now_s: float) -> list[Action]:
        return self._release(request_id, now_s)

    def learn(self, instance: InstanceId, capacity_tokens: Mapping[str, int],
              latency: LatencyModel | None) -> None:  # fmt: skip
        """A request must fit the KV room of whichever instance it runs on: the least."""
        for model, tokens in capacity_tokens.items():
            self.capacity_tokens[model] = min(self.capacity_tokens.get(model, tokens), tokens)

    def on_request_cancelled(self, request_id: str, now_s: float) -> list[Action]:
        instance = self._instance_of.get(request_id)
        actions: list[Action] = [Cancel(instance, request_id)] if instance is not None else []
        return actions + self._release(request_id, now_s)
