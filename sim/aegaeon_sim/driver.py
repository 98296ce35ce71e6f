"""The discrete-event loop: feeds a policy events and carries out its actions.

Global events (arrivals, prefill completions) are taken in time order from a
heap. Decode and unified instances are *lazy*: before any event at time T,
:meth:`Simulation.sync` advances them to T. An instance stops right after an
iteration that finished requests; those finishes are handed to the policy in
global time order (a heap over instances), since with request-level policies
a finish can hand the global queue's head to that instance. Anything the
policy does at time ``e`` touches only the finishing instance or idle ones,
so advancing the others past ``e`` with steps that finish nothing is exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aegaeon_sched import (
    Action,
    Cancel,
    EnqueuePrefill,
    LatencyModel,
    PlaceDecode,
    Policy,
    Reject,
    Request,
    RunOnInstance,
)

from aegaeon_sim.decode_sim import DecodeSim
from aegaeon_sim.prefill_sim import PrefillSim
from aegaeon_sim.state import SimRequest
from aegaeon_sim.switching import Switching
from aegaeon_sim.unified_sim import MuxSim, RequestLevelSim


class LazyInstance(Protocol):
    name: str
    finished: list[SimRequest]
    wake_s: float

    def advance(self, horizon_s: float) -> float | None: ...


class Simulation:
    def __init__(
        self,
        policy: Policy,
        latency: LatencyModel,
        requests: Sequence[Request],
        *,
        kv_bytes_per_s: float,
        always_advance: bool = False,
    ) -> None:
        self.policy = policy
        # Ignore wake times and advance every instance at every event (slow;
        # the tests use it to validate the shortcut).
        self.always_advance = always_advance
        self.latency = latency
        self.kv_bytes_per_s = kv_bytes_per_s
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.sims: dict[str, SimRequest] = {r.request_id: SimRequest(r) for r in self.requests}
        self.rejected: set[str] = set()
        self.prefill: dict[str, PrefillSim] = {}
        self.decode: dict[str, DecodeSim] = {}
        self.unified: dict[str, RequestLevelSim | MuxSim] = {}
        self.lazy: list[LazyInstance] = []
        self._lazy_index: dict[str, int] = {}
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self._handlers: dict[type, Callable[[Any, float], None]] = {
            EnqueuePrefill: self._enqueue_prefill,
            PlaceDecode: self._place_decode,
            RunOnInstance: self._run_on_instance,
            Reject: self._reject,
            Cancel: self._cancel,
        }

    # ---- wiring ---------------------------------------------------------
    def add_prefill(
        self,
        name: str,
        *,
        switching: Switching,
        prefetch: bool,
        latency: LatencyModel | None = None,
        overhead_s: float = 0.0,
        default_ttft_s: float = 0.0,
    ) -> PrefillSim:
        """A prefill instance; ``latency``: what its prefills take (default: the policy's);
        ``default_ttft_s``: the policy's (its mirror queue's order)."""
        sim = PrefillSim(
            name, latency or self.latency, self.schedule, self._prefill_started,
            self._prefill_done, switching=switching, prefetch=prefetch, overhead_s=overhead_s,
            default_ttft_s=default_ttft_s,
        )  # fmt: skip
        self.prefill[name] = sim
        return sim

    def add_decode(self, instance: DecodeSim) -> None:
        self.decode[instance.name] = instance
        self._lazy_index[instance.name] = len(self.lazy)
        self.lazy.append(instance)

    def add_unified(self, instance: RequestLevelSim | MuxSim) -> None:
        self.unified[instance.name] = instance
        self._lazy_index[instance.name] = len(self.lazy)
        self.lazy.append(instance)

    def adapter_loads(self) -> int:
        """LoRA adapters brought to an instance so far (adapters.py), every instance."""
        instances = [*self.prefill.values(), *self.decode.values(), *self.unified.values()]
        return sum(i.adapters.num_loads for i in instances)

    def schedule(self, at_s: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (at_s, next(self._seq), callback))

    # ---- actions --------------------------------------------------------
    def apply(self, actions: list[Action], now_s: float) -> None:
        for action in actions:
            self._handlers[type(action)](action, now_s)

    def _enqueue_prefill(self, action: EnqueuePrefill, now_s: float) -> None:
        index = self._lazy_index.get(action.instance)
        if index is not None:  # a hybrid: its decoding pauses from now on
            self._catch_up(self.lazy[index], now_s)
        self.prefill[action.instance].enqueue(
            self.sims[action.request.request_id], action.group_id, now_s
        )

    @staticmethod
    def _catch_up(instance: LazyInstance, now_s: float) -> None:
        """Bring a lazy instance up to now before it is handed work (exact: it
        has no finish before its wake time, which is after now)."""
        if instance.advance(now_s) is not None:
            raise RuntimeError(f"{instance.name}: a finish before its wake time")

    def _place_decode(self, action: PlaceDecode, now_s: float) -> None:
        sim = self.sims[action.request.request_id]
        kv = action.request.prompt_len * self.latency.spec(action.request.model).kv_bytes_per_token
        sim.ready_s = now_s + 2.0 * kv / self.kv_bytes_per_s  # device -> host -> device
        decode = self.decode[action.instance]
        # It sees the newcomer no earlier than it was placed (a new batch may
        # end a one-model round, or take the next turn).
        self._catch_up(decode, now_s)
        decode.place(sim, action.batch_id, now_s)

    def _run_on_instance(self, action: RunOnInstance, now_s: float) -> None:
        self.unified[action.instance].run(self.sims[action.request.request_id], action.model, now_s)

    def _reject(self, action: Reject, now_s: float) -> None:
        self.rejected.add(action.request.request_id)

    def _cancel(self, action: Cancel, now_s: float) -> None:
        raise RuntimeError("the simulator never cancels requests")

    # ---- prefill callbacks ----------------------------------------------
    def _prefill_started(self, instance: str, request_id: str, now_s: float) -> None:
        self.apply(self.policy.on_prefill_started(instance, request_id, now_s), now_s)

    def _prefill_done(
        self, instance: str, request_id: str, measured_s: float, now_s: float
    ) -> None:
        sim = self.sims[request_id]
        sim.emit(now_s, 0.0, 1)
        if sim.remaining <= 0:
            sim.finished_s = now_s
            self.apply(self.policy.on_request_finished(request_id, now_s), now_s)
            return
        self.apply(self.policy.on_prefill_done(instance, request_id, measured_s, now_s), now_s)

    # ---- the loop -------------------------------------------------------
    def sync(self, horizon_s: float) -> None:
        """Advance every lazy instance to ``horizon_s``, reporting finishes in time order."""
        pending: list[tuple[float, int, LazyInstance]] = []
        waiting: set[int] = set()  # instances stopped at a finish not yet reported
        for index, inst in enumerate(self.lazy):
            if inst.wake_s > horizon_s and not self.always_advance:
                continue  # nothing visible changes there before horizon_s
            stop = inst.advance(horizon_s)
            if stop is not None:
                heapq.heappush(pending, (stop, index, inst))
                waiting.add(index)
        while pending:
            at_s, index, inst = heapq.heappop(pending)
            waiting.discard(index)
            done, inst.finished = inst.finished, []
            touched: set[int] = {index}
            for sim in done:
                actions = self.policy.on_request_finished(sim.request.request_id, at_s)
                self.apply(actions, at_s)
                for action in actions:
                    if isinstance(action, RunOnInstance):
                        touched.add(self._lazy_index[action.instance])
            for i in touched - waiting:
                stop = self.lazy[i].advance(horizon_s)
                if stop is not None:
                    heapq.heappush(pending, (stop, i, self.lazy[i]))
                    waiting.add(i)

    def run(self, end_s: float) -> None:
        """Simulate until ``end_s`` (arrivals after it are never delivered)."""
        arrivals = iter(self.requests)
        nxt = next(arrivals, None)
        while True:
            t_arrival = nxt.arrival_s if nxt is not None else math.inf
            t_event = self._events[0][0] if self._events else math.inf
            t = min(t_arrival, t_event)
            if t > end_s or math.isinf(t):
                break
            self.sync(t)
            self.now = t
            if t_event <= t_arrival:
                _, _, callback = heapq.heappop(self._events)
                callback(t)
            else:
                assert nxt is not None
                self.apply(self.policy.on_arrival(nxt, t), t)
                nxt = next(arrivals, None)
        self.sync(end_s)
        self.now = end_s
