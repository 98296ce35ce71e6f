"""Weighted round-robin quotas for decode instances (Algorithm 2, Eq. 2-3).

At the start of each round the work list is grouped by model and batch ``i``
gets the time quota

    q_i   = c / (n_i (alpha - sum_k 1/n_k)),      n_k = d / t_k
    alpha = max(c / (min_k n_k * Q_MAX) + sum_k 1/n_k, 0.5)

with ``t_k`` the estimated decode step time of batch ``k``, ``d`` the target
TBT and ``c`` the sum of the switch times of the distinct models in the list.
Every batch then emits ``q_i / t_i = c / (d (alpha - S))`` tokens per round
of length ``c alpha / (alpha - S)``, i.e. a fraction ``1/alpha`` of what its
deadlines require, and ``q_i <= Q_MAX``.

Edge cases (the equations are silent on them):

- empty work list: an empty plan.
- one model only (one batch, or several batches of one model because of KV
  room): no model switch is needed, ``c = 0`` and Eq. 2 would give zero
  quotas; each batch gets ``Q_MAX`` instead, and the instance re-plans at the
  end of the turn, so a lone batch simply keeps decoding (new work is picked
  up at the next round, at most ``Q_MAX`` later).
- ``t_k >= d`` (a step slower than the TBT target): nothing special; ``n_k <= 1``
  makes ``alpha > 1`` and the formula degrades gracefully (attainment ``1/alpha``).
- ``t_k <= 0`` (no estimate yet): treated as a tiny positive step time.
- every quota is at least one step (``q_i >= t_i``), so each batch advances
  every round whatever the numbers say.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aegaeon_sched.decode import DecodeWorkList
from aegaeon_sched.latency import LatencyModel

Q_MAX_S = 4.0
ALPHA_MIN = 0.5
_MIN_STEP_S = 1e-6


@dataclass(frozen=True)
class BatchLoad:
    """A batch as the planner sees it."""

    batch_id: int
    model: str
    step_s: float  # estimated decode step time t_k


@dataclass(frozen=True)
class Turn:
    batch_id: int
    model: str
    quota_s: float


@dataclass(frozen=True)
class RoundPlan:
    turns: tuple[Turn, ...]
    alpha: float  # reciprocal of the round's estimated SLO attainment
    switch_s: float  # c
    round_s: float  # estimated length: sum of quotas + c


class RoundRobinPlanner:
    """Computes a round's order and quotas; pure, so live and simulated decode share it."""

    def __init__(
        self, tbt_s: float = 0.1, q_max_s: float = Q_MAX_S, alpha_min: float = ALPHA_MIN
    ) -> None:
        if tbt_s <= 0 or q_max_s <= 0:
            raise ValueError("tbt_s and q_max_s must be positive")
        self.tbt_s = tbt_s
        self.q_max_s = q_max_s
        self.alpha_min = alpha_min

    @staticmethod
    def order(batches: Sequence[BatchLoad]) -> list[BatchLoad]:
        """Same-model batches adjacent; stable otherwise (Alg. 2, line 6)."""
        by_model: dict[str, list[BatchLoad]] = {}
        for b in batches:
            by_model.setdefault(b.model, []).append(b)
        return [b for group in by_model.values() for b in group]

    def plan(self, batches: Sequence[BatchLoad], switch_s: Mapping[str, float]) -> RoundPlan:
        """Plan one round. ``switch_s`` maps each model to its switch estimate."""
        ordered = self.order(batches)
        if not ordered:
            return RoundPlan((), 0.0, 0.0, 0.0)
        models = {b.model for b in ordered}
        steps = [max(b.step_s, _MIN_STEP_S) for b in ordered]
        if len(models) == 1:
            turns = tuple(
                Turn(b.batch_id, b.model, max(self.q_max_s, t))
                for b, t in zip(ordered, steps, strict=True)
            )
            inv_n = sum(t / self.tbt_s for t in steps)
            return RoundPlan(turns, max(inv_n, self.alpha_min), 0.0, sum(t.quota_s for t in turns))
        c = sum(switch_s[m] for m in models)
        n = [self.tbt_s / t for t in steps]
        inv_sum = sum(1.0 / nk for nk in n)
        alpha = max(c / (min(n) * self.q_max_s) + inv_sum, self.alpha_min)
        slack = alpha - inv_sum
        turns_list: list[Turn] = []
        for b, nk, t in zip(ordered, n, steps, strict=True):
            # slack > 0 whenever c > 0 (alpha >= inv_sum + c/(min n Q_MAX));
            # c == 0 only if every switch estimate is zero: run Q_MAX then.
            q = c / (nk * slack) if c > 0 and slack > 0 else self.q_max_s
            turns_list.append(Turn(b.batch_id, b.model, max(q, t)))
        turns = tuple(turns_list)
        return RoundPlan(turns, alpha, c, sum(t.quota_s for t in turns) + c)

    def plan_work_list(
        self,
        work_list: DecodeWorkList,
        latency: LatencyModel,
        context_tokens: Callable[[str], int],
    ) -> RoundPlan:
        """Alg. 2, lines 5-7, on a decode instance's work list.

        Regroups the list by model (in place), estimates each batch's step
        time with Eq. 6 from its requests' current context lengths
        (``context_tokens(request_id)``: prompt plus tokens generated so far)
        and plans the quotas with Eq. 4 switch estimates.
        """
        loads = []
        for batch in work_list.group_by_model():
            context = sum(context_tokens(rid) for rid in batch.requests)
            step = latency.decode_step_s(batch.model, len(batch), context)
            loads.append(BatchLoad(batch.batch_id, batch.model, step))
        return self.plan(loads, {b.model: latency.switch_s(b.model) for b in loads})
