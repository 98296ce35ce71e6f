"""A simulated Aegaeon decode instance (Algorithm 2 rounds).

It keeps the *same* mirror work list a live decode instance keeps
(:class:`~aegaeon_sched.DecodeWorkList`), fed by the policy's actions, and
plans its rounds with the same :class:`~aegaeon_sched.RoundRobinPlanner`,
asking it (:meth:`~aegaeon_sched.RoundRobinPlanner.replan_due`) whether a
batch that arrived mid-round ends the round early: at once when the round
has no switch (one model), at the next turn boundary with ``fresh_first``.

Costs on the decode side (per turn, on the critical path):

- model switch, priced by ``costs.switching`` (switching.py). Prefetching
  (section 5.2): when a turn starts decoding, the instance starts loading the
  model of the next turn with a different model (or, at the end of a round,
  the first other model of the work list) in the background; a switch to it
  exposes what is left of that load (a wrong guess: a full switch).
- KV swap-in of the batch (context tokens x KV bytes per token at
  ``kv_bytes_per_s``) whenever the turn's batch differs from the previous
  turn's; the swap-out of the previous batch overlaps (section 5.3).
- a newly placed request joins its batch once its prompt KV has gone device
  -> host -> device: ``2 x prompt KV bytes`` after its prefill ends.
- ``costs``' per-turn and per-step overheads and the planner's switch
  estimate (Eq. 4, or as live, learned from turns): zero and Eq. 4 for the
  paper's H800s, measured for a replayed CPU node (node.py).

``estimator``: the latency model the planner estimates step times with
(default: ``latency``, what steps take). A round re-planned mid-way serves
the batches that have had a turn since the last complete round last, as the
live decode loop does (:class:`~aegaeon_sched.ServedInRound`).
"""

from __future__ import annotations

import math
from enum import Enum

from aegaeon_sched import (
    DecodeWorkList,
    LatencyModel,
    RoundPlan,
    RoundRobinPlanner,
    ServedInRound,
    Turn,
)

from aegaeon_sim.state import SimRequest, steps_until, steps_within
from aegaeon_sim.switching import InstanceCosts, SwitchEstimate, switch_cost
from aegaeon_sim.turn_meter import TurnMeter


class Phase(Enum):
    ROUND_START = 0
    SWITCH = 1
    DECODE = 2


class DecodeSim:
    """One decode instance: weighted round robin over its mirror work list."""

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
    ) -> None:
        self.name = name
        self.latency = latency
        self.estimator = estimator or latency
        self.planner = planner
        self.kv_bytes_per_s = kv_bytes_per_s
        self.costs = costs
        self.switch_estimate = SwitchEstimate(self.estimator, costs.learned_switch_estimate)
        self.meter = TurnMeter(self.estimator, self.switch_estimate)
        self.prefetch_enabled = prefetch
        self.work = DecodeWorkList()
        self.sims: dict[str, SimRequest] = {}
        self.finished: list[SimRequest] = []
        self.clock = 0.0
        self.phase = Phase.ROUND_START
        self.loaded: str | None = None
        self.prefetch: tuple[str, float] | None = None
        self.plan = RoundPlan((), 0.0, 0.0, 0.0)
        self.turns: list[Turn] = []
        self.turn_idx = 0
        self.turned: set[int] = set()  # batches that have had a turn (not fresh)
        self.served = ServedInRound()
        self.batch_id = -1
        self.last_batch_id = -1
        self.busy_until = 0.0
        self.quota_end = 0.0
        self.switch_costs: list[float] = []  # exposed part of every model switch
        self.num_rounds = 0
        self.wake_s = math.inf

    def place(self, sim: SimRequest, batch_id: int, now_s: float) -> None:
        if not self.sims:
            self.clock = max(self.clock, now_s)  # idle until now
        new_batch = self.work.batch(batch_id) is None
        self.work.add(sim.request, batch_id)
        self.sims[sim.request.request_id] = sim
        # The newcomer can end the current chunk (a join), the turn (a new
        # batch may end a one-model round) or finish early.
        self.wake_s = min(self.wake_s, self.clock, sim.ready_s)
        if new_batch and self.planner.fresh_first and self.phase is Phase.DECODE:
            self._retarget_prefetch(sim.request.model, max(now_s, self.clock))

    def _retarget_prefetch(self, model: str, now_s: float) -> None:
        """A fresh batch takes the next turn: load its model instead, unless
        an earlier fresh batch is already waiting for that turn."""
        planned = {t.batch_id for t in self.turns}
        unplanned = [b for b in self.work if b.batch_id not in planned]
        if self.prefetch_enabled and len(unplanned) == 1 and model != self.loaded:
            self.prefetch = (model, now_s)

    # ---- turn bookkeeping ------------------------------------------------
    def _plan_round(self) -> None:
        """Plan a round; after a cut one, the batches already served go last."""
        self.turned &= {b.batch_id for b in self.work}
        self.plan = self.planner.plan_work_list(
            self.work, self.estimator, lambda rid: self.sims[rid].context,
            turned_ids=self.turned,
            served_ids=self.served.for_plan(b.batch_id for b in self.work),
            switch_s=self.switch_estimate, decode_share=self.decode_share(),
        )  # fmt: skip
        self.turns = list(self.plan.turns)
        self.turn_idx = -1
        self.num_rounds += 1
        self._next_turn()

    def decode_share(self) -> float:
        """The part of this instance's time left for decoding (hybrids: below 1)."""
        return 1.0

    def _replan_due(self, *, mid_turn: bool) -> bool:
        return self.planner.replan_due(
            self.plan, (b.batch_id for b in self.work), mid_turn=mid_turn
        )

    def _next_turn(self) -> None:
        self.meter.end(self.clock)  # the turn in progress, if any, ends now
        if self.turn_idx >= 0 and self._replan_due(mid_turn=False):
            self._plan_round()
            return
        self.turn_idx += 1
        if self.turn_idx >= len(self.turns):
            self.served.round_ended()
            self.phase = Phase.ROUND_START
            return
        turn = self.turns[self.turn_idx]
        batch = self.work.batch(turn.batch_id)
        if batch is None:  # emptied since the round was planned
            self._next_turn()
            return
        cost = self.costs.turn_overhead_s
        switched = turn.model != self.loaded
        if switched:
            cost += self._switch_cost(turn.model)
            self.loaded = turn.model
        if turn.batch_id != self.last_batch_id:
            present = [self.sims[r] for r in batch.requests if self.sims[r].ready_s <= self.clock]
            kv_bytes = self.latency.spec(turn.model).kv_bytes_per_token
            cost += sum(s.context for s in present) * kv_bytes / self.kv_bytes_per_s
        self.batch_id = self.last_batch_id = turn.batch_id
        self.turned.add(turn.batch_id)
        self.served.turn_began(turn.batch_id)
        self.phase = Phase.SWITCH
        self.meter.start(turn.model, self.clock, turn.quota_s, switched)
        self.busy_until = self.clock + cost
        self.quota_end = self.busy_until + turn.quota_s

    def _switch_cost(self, model: str) -> float:
        cost = switch_cost(self.costs.switching, model, self.prefetch, self.clock)
        self.prefetch = None
        self.switch_costs.append(cost)
        return cost

    def _start_prefetch(self) -> None:
        if not self.prefetch_enabled:
            return
        later = [t.model for t in self.turns[self.turn_idx + 1 :]]
        later += [b.model for b in self.work]
        nxt = next((m for m in later if m != self.loaded), None)
        self.prefetch = (nxt, self.clock) if nxt is not None else None

    # ---- simulation ------------------------------------------------------
    def advance(self, horizon_s: float) -> float | None:
        """Run until ``horizon_s``; stop early right after a step that finished
        requests (returns its end time; they are in :attr:`finished`).

        Sets :attr:`wake_s`: nothing the policy can see (a finish) happens on
        this instance before it, so the driver need not advance it earlier.
        """
        while True:
            if self.phase is Phase.ROUND_START:
                if not self.sims:
                    self.wake_s = math.inf
                    return None
                earliest = min(s.ready_s for s in self.sims.values())
                if earliest > self.clock:  # nothing decodable yet: wait for KV
                    if earliest > horizon_s:
                        self.wake_s = earliest
                        return None
                    self.clock = earliest
                self._plan_round()
                continue
            if self.phase is Phase.SWITCH:
                if self.busy_until > horizon_s:
                    self.wake_s = self.busy_until
                    return None
                self.clock = self.busy_until
                self.phase = Phase.DECODE
                self._start_prefetch()
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
        batch = self.work.batch(self.batch_id)
        clock = self.clock
        if batch is None or clock >= self.quota_end:
            self._next_turn()
            return False
        if self.plan.switch_s == 0 and self._replan_due(mid_turn=True):
            self._plan_round()  # a one-model round ends when another batch arrives
            return False
        members: list[SimRequest] = []
        next_join = math.inf
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
        if not members:
            if next_join >= self.quota_end:
                self._next_turn()
                return False
            if next_join > horizon_s:
                self.wake_s = next_join
                return None
            self.clock = next_join
            return False
        engine = self.latency.decode_step_s(batch.model, len(members), context)
        cold = self.meter.cold
        if cold:  # the first step after a switch, on its own
            engine += self.costs.cold_step_s
        step = engine + self.costs.step_overhead_s
        n = min(
            1 if cold else min_remaining,
            steps_until(clock, step, self.quota_end),
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
