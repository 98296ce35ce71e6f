"""A simulated Aegaeon decode instance (Algorithm 2 rounds).

It keeps the *same* mirror work list a live decode instance keeps
(:class:`~aegaeon_sched.DecodeWorkList`), fed by the policy's actions, and
runs its rounds with the same :class:`~aegaeon_sched.RoundController` the
live decode loop runs (aegaeon_runtime.decode): the controller plans each
round (Eq. 2-3 and the round bound), says which batch takes the next turn,
when a turn is over (quota spent, batch emptied, a one-model round cut by a
new batch) and which model to prefetch behind it; this file only prices
what the live loop would spend.

As the live loop, which reads its inbox between decode steps, the instance
sees a placement at its next step boundary: a request placed while a step
(or a switch) is in progress waits in :attr:`DecodeSim.inbox` until it ends,
and the step in progress ends the chunk.

Costs on the decode side (per turn, on the critical path):

- model switch, priced by ``costs.switching`` (switching.py). Prefetching
  (section 5.2): the model the controller names when a turn starts is loaded
  in the background from the turn's first step; a switch to it exposes what
  is left of that load (a wrong guess: a full switch). As the live switcher
  (``ModelSwitcher.prefetch``), one prefetch at a time: one in flight (or
  done) stays until a switch takes or drops it.
- KV swap-in of the batch (context tokens x KV bytes per token at
  ``kv_bytes_per_s``) whenever the turn's batch differs from the previous
  turn's; the swap-out of the previous batch overlaps (section 5.3).
- a newly placed request joins its batch once its prompt KV has gone device
  -> host -> device: ``2 x prompt KV bytes`` after its prefill ends; a turn
  whose requests all wait for their KV waits (as the live loop polls its
  events) until one arrives or the quota is spent.
- ``costs``' per-turn and per-step overheads and the planner's switch
  estimate (Eq. 4, or as live, learned from turns): zero and Eq. 4 for the
  paper's H800s, measured for a replayed CPU node (node.py).

``estimator``: the latency model the planner estimates step times with
(default: ``latency``, what steps take).
"""

from __future__ import annotations

import math
from enum import Enum

from aegaeon_sched import (
    DecodeWorkList,
    LatencyModel,
    RoundController,
    RoundRobinPlanner,
)

from aegaeon_sim.adapters import AdapterLoads
from aegaeon_sim.state import SimRequest, steps_until, steps_within
from aegaeon_sim.switching import InstanceCosts, SwitchEstimate, switch_cost
from aegaeon_sim.turn_meter import TurnMeter

# A step takes at least this long. Eq. 6 is clamped at zero, and a profile fitted
# on a busy machine can have a negative context slope (seen: a 19M model at 2k
# tokens); a step of no time would emit a whole request at one instant.
MIN_STEP_S = 1e-6


class Phase(Enum):
    ROUND_START = 0
    SWITCH = 1
    DECODE = 2


class DecodeSim:
    """One decode instance: weighted round robin over its mirror work list.

    ``rounds``: its round controller (default: one over ``planner``).
    """

    def __init__(
        self,
        name: str,
        latency: LatencyModel,
        planner: RoundRobinPlanner,
        *,
        kv_bytes_per_s: float,
        costs: InstanceCosts,
        prefetch: bool = True,
        estimator: LatencyModel | None = None,
        rounds: RoundController | None = None,
    ) -> None:
        self.name = name
        self.latency = latency
        self.estimator = estimator or latency
        self.rounds = rounds or RoundController(planner)
        self.kv_bytes_per_s = kv_bytes_per_s
        self.costs = costs
        self.switch_estimate = SwitchEstimate(self.estimator, costs.learned_switch_estimate)
        self.meter = TurnMeter(self.estimator, self.switch_estimate)
        self.prefetch_enabled = prefetch
        self.work = DecodeWorkList()
        self.sims: dict[str, SimRequest] = {}
        # Placements not seen yet (made during a step or a switch): (time, request, batch).
        self.inbox: list[tuple[float, SimRequest, int]] = []
        self.finished: list[SimRequest] = []
        self.clock = 0.0
        self.phase = Phase.ROUND_START
        self.loaded: str | None = None
        self.prefetch: tuple[str, float] | None = None
        self.next_prefetch: str | None = None  # named at a turn's start, loaded from its first step
        self.batch_id = -1
        self.last_batch_id = -1
        self.busy_until = 0.0
        self.switch_costs: list[float] = []  # exposed part of every model switch
        self.adapters = AdapterLoads(latency)  # LoRA adapters' matrices held here
        self.wake_s = math.inf

    @property
    def num_rounds(self) -> int:
        return self.rounds.num_rounds

    @property
    def quota_end(self) -> float:
        return self.rounds.quota_end_s

    def place(self, sim: SimRequest, batch_id: int, now_s: float) -> None:
        self.sims[sim.request.request_id] = sim
        if self.phase is Phase.ROUND_START or self.clock >= now_s:
            if self.phase is Phase.ROUND_START and not self.work.num_requests:
                self.clock = max(self.clock, now_s)  # idle until now
            self.work.add(sim.request, batch_id)
        else:  # seen when the step or switch in progress ends
            self.inbox.append((now_s, sim, batch_id))
        # The newcomer can end the current chunk (a join, a cut), the turn or
        # the wait for a round's first ready request.
        self.wake_s = min(self.wake_s, self.clock, sim.ready_s)

    def _receive(self, until_s: float) -> None:
        """Take the placements made by ``until_s`` into the work list."""
        while self.inbox and self.inbox[0][0] <= until_s:
            _, sim, batch_id = self.inbox.pop(0)
            self.work.add(sim.request, batch_id)

    # ---- turn bookkeeping ------------------------------------------------
    def _plan_round(self) -> None:
        self.rounds.plan_round(
            self.work, self.estimator, lambda rid: self.sims[rid].context,
            self.switch_estimate, now_s=self.clock, prefill_busy_s=self.prefill_busy_s(),
        )  # fmt: skip
        self._next_turn()

    def prefill_busy_s(self) -> float:
        """Seconds this instance has spent prefilling (a hybrid's decode share)."""
        return 0.0

    def _next_turn(self) -> None:
        self.meter.end(self.clock)  # the turn in progress, if any, ends now
        turn = self.rounds.next_turn(self.work)
        if turn is None:
            self.phase = Phase.ROUND_START
            return
        batch = self.work.batch(turn.batch_id)
        assert batch is not None  # the controller skips emptied batches
        cost = self.costs.turn_overhead_s
        switched = turn.model != self.loaded
        if switched:
            cost += self._switch_cost(turn.model)
            self.loaded = turn.model
        present = [self.sims[r] for r in batch.requests if self.sims[r].ready_s <= self.clock]
        if turn.batch_id != self.last_batch_id:
            kv_bytes = self.latency.spec(turn.model).kv_bytes_per_token
            cost += sum(s.context for s in present) * kv_bytes / self.kv_bytes_per_s
        cost += sum(self.adapters.load_s(s.request) for s in present)  # LoRA: first runs
        if self.prefetch_enabled:
            self.next_prefetch = self.rounds.prefetch_model(self.work)
        self.batch_id = self.last_batch_id = turn.batch_id
        self.phase = Phase.SWITCH
        self.meter.start(turn.model, self.clock, turn.quota_s, switched)
        self.busy_until = self.clock + cost

    def _switch_cost(self, model: str) -> float:
        cost = switch_cost(self.costs.switching, model, self.prefetch, self.clock)
        self.prefetch = None
        self.switch_costs.append(cost)
        return cost

    # ---- simulation ------------------------------------------------------
    def advance(self, horizon_s: float) -> float | None:
        """Run until ``horizon_s``; stop early right after a step that finished
        requests (returns its end time; they are in :attr:`finished`).

        Sets :attr:`wake_s`: nothing the policy can see (a finish) happens on
        this instance before it, so the driver need not advance it earlier.
        """
        while True:
            if self.phase is Phase.ROUND_START:
                self._receive(self.clock)
                if not self.work.num_requests:
                    if not self.inbox:
                        self.wake_s = math.inf
                        return None
                    if self.inbox[0][0] > horizon_s:
                        self.wake_s = self.inbox[0][0]
                        return None
                    self.clock = self.inbox[0][0]
                    continue
                earliest = min(self.sims[r].ready_s for b in self.work for r in b.requests)
                if earliest > self.clock:  # nothing decodable yet: wait for KV
                    if earliest > horizon_s:
                        self.wake_s = earliest
                        return None
                    self.clock = earliest
                    continue
                self._plan_round()
                continue
            if self.phase is Phase.SWITCH:
                if self.busy_until > horizon_s:
                    self.wake_s = self.busy_until
                    return None
                self.clock = self.busy_until
                self.phase = Phase.DECODE
                self.rounds.start_quota(self.clock)
                if self.prefetch is None and self.next_prefetch is not None:
                    self.prefetch = (self.next_prefetch, self.clock)
                continue
            done = self._decode(horizon_s)
            if done is None:
                return None
            if done:
                self.wake_s = self.clock
                return self.clock

    def _decode(self, horizon_s: float) -> bool | None:
        """One chunk of the current turn: ``True`` if requests finished,
        ``False`` to keep going, ``None`` to stop at the horizon."""
        clock = self.clock
        self._receive(clock)
        if self.rounds.turn_over(self.work, clock) is not None:
            self._next_turn()
            return False
        batch = self.work.batch(self.batch_id)
        assert batch is not None
        quota_end = self.rounds.quota_end_s
        members: list[SimRequest] = []
        # The chunk ends at the first step boundary after a join or a placement.
        next_join = self.inbox[0][0] if self.inbox else math.inf
        context = 0
        min_remaining = 1 << 30
        sims = self.sims
        for rid in batch.requests:
            sim = sims[rid]
            if sim.ready_s <= clock:
                members.append(sim)
                context += sim.prompt_len + sim.generated
                remaining = sim.output_len - sim.generated
                if remaining < min_remaining:  # noqa: PLR1730 (hot loop: no call)
                    min_remaining = remaining
            elif sim.ready_s < next_join:
                next_join = sim.ready_s
        if not members:  # every request waits for its KV: wait, up to the quota's end
            until = min(next_join, quota_end)
            if until > horizon_s:
                self.wake_s = until
                return None
            self.clock = until
            return False
        engine = self.latency.decode_step_s(batch.model, len(members), context)
        cold = self.meter.cold
        if cold:  # the first step after a switch, on its own
            engine += self.costs.cold_step_s
        step = max(engine + self.costs.step_overhead_s, MIN_STEP_S)
        n = min(
            1 if cold else min_remaining,
            steps_until(clock, step, quota_end),
            steps_until(clock, step, next_join),
        )
        fits = steps_within(clock, step, horizon_s)
        cut = fits < n
        if cut:  # the horizon falls inside the chunk: commit what ends before it
            self.wake_s = clock + n * step  # the chunk's end, the next possible finish
            n = fits
            if n <= 0:
                return None
        for sim in members:
            sim.chunks.append((clock + step, step, n))
            sim.generated += n
        self.clock = clock + n * step
        self.meter.steps(batch.model, len(members), context, engine, n)
        self.meter.cold = False
        if cut:
            return None
        if n < min_remaining:
            return False
        done = [s for s in members if s.generated >= s.output_len]
        for sim in done:
            sim.finished_s = self.clock
            self.work.remove(sim.request.request_id)
            del sims[sim.request.request_id]
            self.finished.append(sim)
        return True
