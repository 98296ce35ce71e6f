"""A simulated prefill instance (Algorithm 1's execution side).

It keeps the *same* mirror queue a live prefill instance keeps
(:class:`~aegaeon_sched.PrefillQueue`), fed by the policy's actions, and runs
its front group one request at a time (batch size 1, section 4.2), switching
models when the group's model is not the loaded one. Like the live instance
(services/prefill) and the paper's artifact (``PrefillStageUniBatchScheduler``
prefetches the first queued group of another model), each prefill starts
loading the model of the first queued group that differs from its own behind
it; a switch to that model then costs what is left of its load (as on decode
instances, priced by a :class:`~aegaeon_sim.switching.Switching`), any
other switch a full one. ``overhead_s``: a prefill's wall time beyond its
compute and switch (KV allocation, the swap-out order); :attr:`compute_s`
sums the compute of finished prefills (a hybrid's heartbeat reports it),
:attr:`switch_s` the switches before them.
"""

from __future__ import annotations

from collections.abc import Callable

from aegaeon_sched import LatencyModel, PrefillQueue

from aegaeon_sim.adapters import AdapterLoads
from aegaeon_sim.state import SimRequest
from aegaeon_sim.switching import Switching, switch_cost


class PrefillSim:
    """One prefill instance: runs its mirror queue's front group one request at a time."""

    def __init__(
        self,
        name: str,
        latency: LatencyModel,
        schedule: Callable[[float, Callable[[float], None]], None],
        on_started: Callable[[str, str, float], None],
        on_done: Callable[[str, str, float, float], None],
        *,
        switching: Switching,
        prefetch: bool = True,
        overhead_s: float = 0.0,
        default_ttft_s: float = 0.0,
    ) -> None:
        """``default_ttft_s``: the policy's (the mirror queue orders groups as the
        dispatcher's, :class:`~aegaeon_sched.PrefillQueue`)."""
        self.name = name
        self.latency = latency
        self.queue = PrefillQueue(default_ttft_s=default_ttft_s)
        self.loaded: str | None = None
        self.busy = False
        self.num_switches = 0
        self.switching = switching
        self.overhead_s = overhead_s
        self.compute_s = 0.0
        self.prefilled_tokens = 0  # prompt tokens of finished prefills (token velocity)
        self.switch_s = 0.0  # exposed switch time of its prefills
        self.adapters = AdapterLoads(latency)  # LoRA adapters' matrices held here
        self.prefetch_enabled = prefetch
        self.prefetch: tuple[str, float] | None = None  # (model, load started at)
        # A hybrid instance pauses its decoding while prefills wait (hybrid_sim.py).
        self.on_busy: Callable[[float], None] = lambda now_s: None
        self.on_idle: Callable[[float], None] = lambda now_s: None
        self._schedule = schedule
        self._on_started = on_started
        self._on_done = on_done

    def enqueue(self, sim: SimRequest, group_id: int, now_s: float) -> None:
        self.queue.add(sim.request, group_id)
        if not self.busy:
            self.on_busy(now_s)
            self._start(now_s)

    def _start(self, now_s: float) -> None:
        head = self.queue.peek()
        if head is None:
            self.busy = False
            self.on_idle(now_s)
            return
        group, request = head
        self.queue.start(request.request_id, now_s)
        self._on_started(self.name, request.request_id, now_s)
        measured = self.latency.prefill_one_s(request.model, request.prompt_len)
        cost = 0.0
        if group.model != self.loaded:
            cost = self._switch_cost(group.model, now_s)
            self.loaded = group.model
            self.num_switches += 1
            self.switch_s += cost
        if self.prefetch_enabled:
            nxt = next((g.model for g in self.queue if g.model != group.model), None)
            if nxt is not None and (self.prefetch is None or self.prefetch[0] != nxt):
                self.prefetch = (nxt, now_s + cost)  # behind the prefill
        cost += self.adapters.load_s(request) + measured + self.overhead_s
        self.busy = True
        rid, tokens = request.request_id, request.prompt_len
        self._schedule(now_s + cost, lambda t: self._finish(rid, measured, t, tokens))

    def _switch_cost(self, model: str, now_s: float) -> float:
        cost = switch_cost(self.switching, model, self.prefetch, now_s)
        self.prefetch = None
        return cost

    def _finish(self, request_id: str, measured_s: float, now_s: float, tokens: int = 0) -> None:
        self.queue.finish(request_id)
        self.compute_s += measured_s
        self.prefilled_tokens += tokens
        self._on_done(self.name, request_id, measured_s, now_s)
        self._start(now_s)
