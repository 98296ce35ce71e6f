"""Simulated unified instances for the baselines (prefill and decode on one GPU).

The engine behaves like vLLM's default scheduler: a waiting request's
prefill runs first (prompts batched up to 8192 tokens), otherwise the running
requests take one decode step together (continuous batching).

- :class:`RequestLevelSim` serves one model at a time; the policy switches it
  (Eq. 4, no prefetch: the next model is unknown until the instance is idle)
  only when it is idle. A replayed live node (node.py) prices its switches as
  measured, prefills one request at a time as the live unified instance does
  (``prefill_one_by_one``) and adds the live loop's wall time per step
  (``step_overhead_s``).
- :class:`MuxSim` holds its (at most two) placed models resident: no switch
  ever; when both have running requests one step of each alternates, so each
  model's tokens come every ``t_a + t_b``. Requests are admitted while their
  ``prompt_len + max_tokens`` KV fits the GPU's KV region (what is left of the
  usable memory after both models' weights), in arrival order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from aegaeon_sched import LatencyModel

from aegaeon_sim.adapters import AdapterLoads
from aegaeon_sim.state import SimRequest, steps_until, steps_within

MAX_PREFILL_TOKENS = 8192  # vLLM's max_num_batched_tokens


class _UnifiedEngine:
    def __init__(self, name: str, latency: LatencyModel) -> None:
        self.name = name
        self.latency = latency
        self.prefill_one_by_one = False
        self.step_overhead_s = 0.0
        self.num_steps = 0
        self.engine_s = 0.0
        self.waiting: dict[str, deque[SimRequest]] = {}
        self.running: dict[str, list[SimRequest]] = {}
        self.finished: list[SimRequest] = []
        self.clock = 0.0
        self.busy_until = 0.0
        self.num_switches = 0
        self.adapters = AdapterLoads(latency)  # LoRA adapters' matrices held here
        self.wake_s = math.inf

    def is_idle(self) -> bool:
        return not any(self.waiting.values()) and not any(self.running.values())

    def _on_finish(self, sim: SimRequest) -> None:
        """Hook: a request left the GPU."""

    def _finish(self, sims: list[SimRequest], model: str) -> bool:
        done = [s for s in sims if s.remaining <= 0]
        if done:
            self.running[model] = [s for s in self.running[model] if s.remaining > 0]
            for sim in done:
                sim.finished_s = self.clock
                self.finished.append(sim)
                self._on_finish(sim)
        return bool(done)

    def advance(self, horizon_s: float) -> float | None:
        """Run until ``horizon_s``; stop right after an iteration that finished
        requests (returns its end time; they are in :attr:`finished`).

        Sets :attr:`wake_s`, before which nothing the policy can see (a
        finish) happens here, so the driver need not advance it earlier.
        """
        while True:
            if self.busy_until > self.clock:
                if self.busy_until > horizon_s:
                    self.wake_s = self.busy_until
                    return None
                self.clock = self.busy_until
            pick: str | None = None
            pick_ready = math.inf
            next_ready = math.inf
            for model, queue in self.waiting.items():
                if queue:
                    next_ready = min(next_ready, queue[0].ready_s)
                    if queue[0].ready_s <= self.clock and queue[0].ready_s < pick_ready:
                        pick, pick_ready = model, queue[0].ready_s
            if pick is not None:
                result = self._prefill(pick, horizon_s)
            elif any(self.running.values()):
                result = self._decode(horizon_s, next_ready)
            elif next_ready <= horizon_s:
                self.clock = next_ready
                continue
            else:
                self.wake_s = next_ready
                return None
            if result is None:
                return None
            if result:
                self.wake_s = self.clock
                return self.clock

    def _prefill(self, model: str, horizon_s: float) -> bool | None:
        queue = self.waiting[model]
        batch: list[SimRequest] = []
        tokens = 0
        while queue and queue[0].ready_s <= self.clock:
            prompt = queue[0].prompt_len
            if batch and (self.prefill_one_by_one or tokens + prompt > MAX_PREFILL_TOKENS):
                break
            batch.append(queue.popleft())
            tokens += prompt
        cost = self.latency.prefill_s(model, [s.prompt_len for s in batch])
        if self.clock + cost > horizon_s:
            queue.extendleft(reversed(batch))
            self.wake_s = self.clock + cost
            return None
        self.clock += cost
        for sim in batch:
            sim.emit(self.clock, 0.0, 1)
        self.running.setdefault(model, []).extend(batch)
        return self._finish(batch, model)

    def _decode(self, horizon_s: float, next_ready: float) -> bool | None:
        clock = self.clock
        active: list[tuple[str, list[SimRequest]]] = []
        steps: list[float] = []
        min_remaining = 1 << 30
        for model, sims in self.running.items():
            if not sims:
                continue
            context = 0
            for sim in sims:
                context += sim.prompt_len + sim.generated
                remaining = sim.output_len - sim.generated
                if remaining < min_remaining:  # noqa: PLR1730 (hot loop: no call)
                    min_remaining = remaining
            active.append((model, sims))
            step = self.latency.decode_step_s(model, len(sims), context)
            steps.append(step + self.step_overhead_s)
        period = sum(steps)
        n = min(min_remaining, steps_until(clock, period, next_ready))
        fits = steps_within(clock, period, horizon_s)
        cut = fits < n
        if cut:
            self.wake_s = clock + n * period
            n = fits
            if n <= 0:
                return None
        offset = 0.0
        for (_, sims), step in zip(active, steps, strict=True):
            offset += step
            for sim in sims:
                sim.chunks.append((clock + offset, period, n))
                sim.generated += n
        self.clock = clock + n * period
        self.num_steps += n * len(active)
        self.engine_s += n * (period - len(active) * self.step_overhead_s)
        if cut:
            return None
        if n < min_remaining:
            return False
        finished = False
        for model, sims in active:
            finished = self._finish(sims, model) or finished
        return finished


class RequestLevelSim(_UnifiedEngine):
    """A unified instance of the request-level auto-scaling baselines.

    ``switch_bytes_per_s`` replaces Eq. 4 by ``weight_bytes / switch_bytes_per_s``
    (e.g. 16 GB/s, what the paper's artifact simulator charged ServerlessLLM);
    ``switch_cost(model)``, if given, prices every switch instead.
    """

    def __init__(
        self,
        name: str,
        latency: LatencyModel,
        switch_bytes_per_s: float | None = None,
        switch_cost: Callable[[str], float] | None = None,
    ) -> None:
        super().__init__(name, latency)
        self.model: str | None = None
        self.switch_bytes_per_s = switch_bytes_per_s
        self.switch_cost = switch_cost

    def switch_s(self, model: str) -> float:
        if self.switch_cost is not None:
            return self.switch_cost(model)
        if self.switch_bytes_per_s is None:
            return self.latency.switch_s(model)
        return self.latency.spec(model).weight_bytes / self.switch_bytes_per_s

    def run(self, sim: SimRequest, model: str, now_s: float) -> None:
        if self.is_idle():
            self.clock = max(self.clock, now_s)
        if model != self.model:
            if not self.is_idle():
                raise RuntimeError(f"{self.name}: switch to {model} while serving {self.model}")
            self.busy_until = max(self.clock, now_s) + self.switch_s(model)
            self.model = model
            self.num_switches += 1
        # an adapter of the model it holds: batched on it, its own matrices loaded once
        load_s = self.adapters.load_s(sim.request)
        if load_s:
            self.busy_until = max(self.busy_until, self.clock, now_s) + load_s
        sim.ready_s = now_s
        self.waiting.setdefault(model, deque()).append(sim)
        self.wake_s = min(self.wake_s, now_s)


class MuxSim(_UnifiedEngine):
    """A GPU of the static multiplexing baseline."""

    def __init__(self, name: str, latency: LatencyModel, kv_budget_bytes: float) -> None:
        super().__init__(name, latency)
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_used_bytes = 0.0
        self.admission: deque[SimRequest] = deque()

    def _kv_need(self, sim: SimRequest) -> float:
        spec = self.latency.spec(sim.request.model)
        return float(sim.request.kv_tokens * spec.kv_bytes_per_token)

    def run(self, sim: SimRequest, model: str, now_s: float) -> None:
        if self.is_idle() and not self.admission:
            self.clock = max(self.clock, now_s)
        sim.ready_s = now_s
        self.admission.append(sim)
        self._admit()
        self.wake_s = min(self.wake_s, now_s)

    def _admit(self) -> None:
        while self.admission:
            need = self._kv_need(self.admission[0])
            if self.kv_used_bytes > 0 and self.kv_used_bytes + need > self.kv_budget_bytes:
                return
            sim = self.admission.popleft()
            self.kv_used_bytes += need
            self.waiting.setdefault(sim.request.model, deque()).append(sim)

    def _on_finish(self, sim: SimRequest) -> None:
        self.kv_used_bytes -= self._kv_need(sim)
        self._admit()
