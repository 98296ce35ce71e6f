"""Weighted round-robin quotas for decode instances (Algorithm 2, Eq. 2-3), and
one bound past the paper.

At the start of each round the work list is grouped by model and batch ``i``
gets the time quota

    q_i   = c / (n_i (alpha - S)),      n_k = d / t_k,      S = sum_k 1/n_k
    alpha = max(c / (min_k n_k * Q_MAX) + S, 0.5)                     (paper)

with ``t_k`` the estimated decode step time of batch ``k``, ``d`` the target
TBT and ``c`` the sum of the switch times of the distinct models in the list.
Every batch then emits ``q_i / t_i = c / (d (alpha - S))`` tokens per round
of length ``c alpha / (alpha - S)``, i.e. a fraction ``1/alpha`` of what its
deadlines require, and ``q_i <= Q_MAX``.

Past the paper: the round bound (``round_ttft_fraction``, on when ``ttft_s``
is given). Eq. 3 bounds the longest *quota*, not the round. Under load
(``S`` near 1) alpha approaches ``S``, quotas approach Q_MAX and a round of N
batches lasts about ``N * Q_MAX``: ~30 s at 8 batches per decode GPU (Fig. 11a,
96 models), three TTFTs. A request placed in a batch that just had its turn
waits that whole round for its first decode step while its tokens are due
from ``arrival + TTFT`` on, so most of them miss. The bound is a third term
of Eq. 3::

    alpha = max(c / (min_k n_k Q_MAX) + S,  0.5,  S + c S / B),   B = f * TTFT

which is exactly ``sum_i q_i <= B`` (the quotas of Eq. 2 sum to
``c S / (alpha - S)``). Quotas keep Eq. 2's proportions, so every batch still
earns the same share ``1/alpha`` of its deadlines' tokens; they only shrink,
and ``alpha`` reports the attainment the shorter round is expected to reach.
``B`` bounds the round's decode time, not its switches: prefetching (section
5.2) loads the next model during a turn at least as long as the load, so
only a small part of ``c`` is exposed. The rest of the TTFT is for what comes
before a request's first decode turn (prefill queueing, the KV handoff, those
exposed switches). Default ``f`` = 0.7 (:data:`ROUND_TTFT_FRACTION`), chosen
in the simulator (Fig. 11a/11b/11c over three seeds, Fig. 13 over two;
interpolated crossing of 90% attainment): 0.6-0.8 serve the most models and
0.7 is best or within 1% of the best on every panel; 0.5 cuts turns below
the time prefetching needs (-2% to -4%, more below), 1.0 lets rounds outgrow
the slack (-3% at Fig. 11a). Against Eq. 3 alone (``None``): 104 vs 72-80
models at Fig. 11a, 72 vs 56-64 at Fig. 11b, 1.5 vs 1.3-1.4 RPS at Fig. 11c.
Shrinking Q_MAX instead (1 s) does as well at 0.1 RPS but worse at 0.5 RPS
(70.7 vs 73.2 models) and at 40 models (1.42 vs 1.52 RPS), and a constant
does not follow the SLO as the bound does.

Also past the paper, off by default (in the simulator it lost 1-2% on top of
the bound, and alone it is worse than Eq. 3: jumping the queue breaks the
prefetch of the planned next model and starves batches with long requests):
``fresh_first`` gives batches that have not had a turn yet
(:attr:`BatchLoad.fresh`) the front of the round, and :meth:`replan_due` asks
for a re-plan at a turn boundary when such a batch arrived mid-round (the
batches already served in the round go last, :attr:`BatchLoad.served`).

Past the paper, SLO classes (:mod:`aegaeon_sched.priority`): ``d`` is per
batch, the tightest TBT of its requests (``BatchLoad.tbt_s``), so
``n_k = d_k / t_k``; Eq. 2 keeps its form and every batch still earns
``1/alpha`` of its own deadlines' tokens. A batch of interactive requests
gets proportionally longer turns than one of batch requests of equal step.

Edge cases (the equations are silent on them):

- empty work list: an empty plan.
- one model only (one batch, or several batches of one model because of KV
  room): no model switch is needed, ``c = 0`` and Eq. 2 would give zero
  quotas; each batch gets ``Q_MAX`` instead (within the round bound), and the
  round ends as soon as another batch arrives (:meth:`replan_due` with
  ``mid_turn=True``): its quota was never meant to keep another model waiting.
- ``t_k >= d`` (a step slower than the TBT target): nothing special; ``n_k <= 1``
  makes ``alpha > 1`` and the formula degrades gracefully (attainment ``1/alpha``).
- ``t_k <= 0`` (no estimate yet): treated as a tiny positive step time.
- every quota is at least one step (``q_i >= t_i``), so each batch advances
  every round whatever the numbers say.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from aegaeon_sched.decode import DecodeWorkList
from aegaeon_sched.latency import LatencyModel

Q_MAX_S = 4.0
ALPHA_MIN = 0.5
ROUND_TTFT_FRACTION = 0.7
_MIN_STEP_S = 1e-6


@dataclass(frozen=True)
class BatchLoad:
    """A batch as the planner sees it."""

    batch_id: int
    model: str
    step_s: float  # estimated decode step time t_k
    fresh: bool = False  # has not had a turn yet (a new batch)
    served: bool = False  # had its turn in the round being re-planned
    tbt_s: float | None = None  # its tightest TBT target d_k (None: the planner's)


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

    @cached_property
    def batch_ids(self) -> frozenset[int]:
        """The batches the round planned for (asked between every two decode steps)."""
        return frozenset(t.batch_id for t in self.turns)


class RoundRobinPlanner:
    """Computes a round's order and quotas; pure, so live and simulated decode share it
    (through :class:`~aegaeon_sched.RoundController`, which runs the rounds).

    ``RoundRobinPlanner(tbt_s, q_max_s)`` is the paper's Eq. 2-3; pass
    ``ttft_s`` to bound each round's decode time by ``round_ttft_fraction *
    ttft_s`` (see the module docstring; ``round_ttft_fraction=None`` turns the
    bound off even with ``ttft_s``).
    """

    def __init__(
        self,
        tbt_s: float = 0.1,
        q_max_s: float = Q_MAX_S,
        alpha_min: float = ALPHA_MIN,
        *,
        ttft_s: float | None = None,
        round_ttft_fraction: float | None = ROUND_TTFT_FRACTION,
        fresh_first: bool = False,
    ) -> None:
        if tbt_s <= 0 or q_max_s <= 0:
            raise ValueError("tbt_s and q_max_s must be positive")
        if ttft_s is not None and ttft_s <= 0:
            raise ValueError("ttft_s must be positive")
        if round_ttft_fraction is not None and round_ttft_fraction <= 0:
            raise ValueError("round_ttft_fraction must be positive")
        self.tbt_s = tbt_s
        self.q_max_s = q_max_s
        self.alpha_min = alpha_min
        self.fresh_first = fresh_first
        self.round_bound_s: float | None = (
            ttft_s * round_ttft_fraction
            if ttft_s is not None and round_ttft_fraction is not None
            else None
        )

    @classmethod
    def paper(cls, tbt_s: float = 0.1, q_max_s: float = Q_MAX_S) -> RoundRobinPlanner:
        """Eq. 2-3 exactly as published: no round bound, no fresh-first."""
        return cls(tbt_s, q_max_s, round_ttft_fraction=None)

    def order(self, batches: Sequence[BatchLoad]) -> list[BatchLoad]:
        """Same-model batches adjacent (Alg. 2, line 6); stable otherwise.

        Batches already served in a round being re-planned go last; with
        ``fresh_first``, models with a fresh batch go first.
        """
        ranked = sorted(batches, key=lambda b: (not (self.fresh_first and b.fresh), b.served))
        by_model: dict[str, list[BatchLoad]] = {}
        for b in ranked:
            by_model.setdefault(b.model, []).append(b)
        return [b for group in by_model.values() for b in group]

    def plan(
        self,
        batches: Sequence[BatchLoad],
        switch_s: Mapping[str, float],
        *,
        decode_share: float = 1.0,
    ) -> RoundPlan:
        """Plan one round. ``switch_s`` maps each model to its switch estimate.

        ``decode_share`` (in (0, 1]; past the paper): the part of the
        instance's time left for decoding, below 1 on a hybrid instance whose
        prefills cut in (:class:`~aegaeon_sched.DecodeShare`). A round of
        decode time ``R`` then lasts ``R / share`` on the wall clock, so the
        TBT target and the round bound are planned as ``share`` times theirs:
        every batch still earns ``1/alpha`` of its deadlines' tokens.
        """
        ordered = self.order(batches)
        if not ordered:
            return RoundPlan((), 0.0, 0.0, 0.0)
        if not 0 < decode_share <= 1:
            raise ValueError("decode_share must be in (0, 1]")
        bound_s = None if self.round_bound_s is None else self.round_bound_s * decode_share
        models = {b.model for b in ordered}
        steps = [max(b.step_s, _MIN_STEP_S) for b in ordered]
        c = sum(switch_s[m] for m in models) if len(models) > 1 else 0.0
        # Each batch's own d_k (SLO classes): q_i / t_i tokens per round are still
        # 1/alpha of the round's c alpha / (alpha - S) seconds over d_i, for every i.
        targets = [(b.tbt_s or self.tbt_s) * decode_share for b in ordered]
        n = [d / t for d, t in zip(targets, steps, strict=True)]
        inv_sum = sum(1.0 / nk for nk in n)
        if c <= 0:
            # No switch in the round (one model, or zero estimates): Q_MAX each,
            # shortened evenly to fit the round bound.
            quota = self.q_max_s
            if bound_s is not None:
                quota = min(quota, bound_s / len(ordered))
            turns = tuple(
                Turn(b.batch_id, b.model, max(quota, t))
                for b, t in zip(ordered, steps, strict=True)
            )
            return RoundPlan(
                turns, max(inv_sum, self.alpha_min), 0.0, sum(t.quota_s for t in turns)
            )
        alpha = max(c / (min(n) * self.q_max_s) + inv_sum, self.alpha_min)
        if bound_s is not None:
            alpha = max(alpha, inv_sum + c * inv_sum / bound_s)
        slack = alpha - inv_sum  # > 0: alpha >= inv_sum + c / (min n Q_MAX)
        turns = tuple(
            Turn(b.batch_id, b.model, max(c / (nk * slack), t))
            for b, nk, t in zip(ordered, n, steps, strict=True)
        )
        return RoundPlan(turns, alpha, c, sum(t.quota_s for t in turns) + c)

    def replan_due(self, plan: RoundPlan, batch_ids: Iterable[int], *, mid_turn: bool) -> bool:
        """Should the instance end the round now and plan afresh?

        ``batch_ids``: the work list now. True when it holds a batch the round
        did not plan for and either the round has no switch (a one-model
        round: also ``mid_turn``, the turn ends at once) or, at a turn
        boundary (``mid_turn=False``), ``fresh_first`` is on. Re-plan with the
        batches served so far in this round marked :attr:`BatchLoad.served`.
        """
        if plan.batch_ids.issuperset(batch_ids):
            return False
        return plan.switch_s == 0 or (self.fresh_first and not mid_turn)

    def plan_work_list(
        self,
        work_list: DecodeWorkList,
        latency: LatencyModel,
        context_tokens: Callable[[str], int],
        *,
        turned_ids: Collection[int] | None = None,
        served_ids: Collection[int] = (),
        switch_s: Callable[[str], float] | None = None,
        decode_share: float = 1.0,
    ) -> RoundPlan:
        """Alg. 2, lines 5-7, on a decode instance's work list.

        Regroups the list by model (in place), estimates each batch's step
        time with Eq. 6 from its requests' current context lengths
        (``context_tokens(request_id)``: prompt plus tokens generated so far)
        and plans the quotas with Eq. 4 switch estimates (or ``switch_s(model)``,
        e.g. a live instance's measured switch overheads). ``turned_ids``: the
        batches that have had a turn (the others are fresh; ``None``: none is
        fresh); ``served_ids``: those served in the round being re-planned;
        ``decode_share``: as :meth:`plan`.
        """
        loads = []
        for batch in work_list.group_by_model():
            context = sum(context_tokens(rid) for rid in batch.requests)
            step = latency.decode_step_s(batch.model, len(batch), context)
            fresh = turned_ids is not None and batch.batch_id not in turned_ids
            served = batch.batch_id in served_ids
            loads.append(BatchLoad(batch.batch_id, batch.model, step, fresh, served, batch.tbt_s))
        estimate = switch_s or latency.switch_s
        switches = {b.model: estimate(b.model) for b in loads}
        return self.plan(loads, switches, decode_share=decode_share)
