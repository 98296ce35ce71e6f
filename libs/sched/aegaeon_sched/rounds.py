"""A decode instance's rounds and turns (Algorithm 2, lines 4-11), decided in one place.

:class:`RoundController` is the one round controller of a decode instance:
the decode loop (``aegaeon_runtime.decode``: ``DecodeLoop.run_round`` and
``TurnRunner.run``, which the simulator runs too, on simulated time) calls these
methods, with the time passed in, and does only what it says:

- :meth:`~RoundController.plan_round`: the work list grouped by model and
  every batch's quota (:meth:`RoundRobinPlanner.plan_work_list`: Eq. 2-3,
  the round bound, a hybrid's decode share from its prefill seconds);
- :meth:`~RoundController.next_turn` at every turn boundary: the next
  planned batch that still has requests, or ``None`` when the round is
  over, either because it ran every turn or because it is cut;
- :meth:`~RoundController.start_quota` once the turn's model is switched in
  (the quota counts decode time, not the switch) and
  :meth:`~RoundController.turn_over` between steps: why the turn ends, if it
  does (:class:`TurnEnd`);
- :meth:`~RoundController.following` and
  :meth:`~RoundController.prefetch_model` at the start of a turn: the order
  of the batches' next turns (the last ones are swapped out first) and the
  model to load behind the turn (paper section 5.2).

Rules, where the live loop and the simulator used to differ:

- **A cut is a batch the round did not plan for** (:meth:`RoundRobinPlanner.replan_due`
  on the set of planned batch ids), not a change in the number of batches (the
  live loop counted them: a batch that left and a new one that came cancelled
  out, and the newcomer waited up to Q_MAX). In a one-model round it ends the
  turn at once (between steps), at a turn boundary with ``fresh_first``. A
  prefill waiting on a hybrid instance ends the turn and the round (it goes
  first). A cut round keeps its served marks (:class:`ServedInRound`): the
  next round serves the batches that have not had their turn first.
- **The prefetch is the first model other than the turn's in**
  :meth:`~RoundController.following`: the round's remaining turns whose batch
  still has requests, then every batch in the order the next round will plan
  them (the work list grouped by model), new batches included; when the
  round will be re-planned at the turn's end (``fresh_first`` and a batch it
  did not plan for), the order that re-plan will give. The
  live loop looked at this round's turns only (a model that arrived in the
  round and runs next round was never prefetched) and the simulator's list
  kept turns of emptied batches (it could prefetch a model nothing waits for).

Pure: no clock, no I/O. The work list is what the instance has seen: the live
loop reads its inbox between steps, the simulator keeps placements made
during a step in its own inbox until the step ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from enum import Enum

from aegaeon_sched.decode import DecodeBatch, DecodeWorkList
from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.quota import BatchLoad, RoundPlan, RoundRobinPlanner, Turn
from aegaeon_sched.share import DecodeShare

# Times within this are equal: a turn that has run its quota to within a nanosecond
# has run it (its steps' times are summed one by one, so the last bits may differ).
TIME_EPS_S = 1e-9


class ServedInRound:
    """Which batches have had a turn since the last decode round that ran to its end.

    A decode instance's round can be cut short (a hybrid's prefill first, a
    one-model round when another batch arrives). The next round is planned
    afresh with the batches that have had a turn since the last complete
    round marked :attr:`~aegaeon_sched.BatchLoad.served`, so the planner
    (:meth:`~aegaeon_sched.RoundRobinPlanner.order`) serves the others first.
    Cut after cut, every batch still gets its turn in work-list order; once
    all of them have had one, the count starts over. Without this book every
    re-plan would restart from the head of the work list and a batch at its
    tail could wait as long as the interruptions keep coming (on the CPU
    node: 1.3 s behind a stream of prefills).
    """

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def turn_began(self, batch_id: int) -> None:
        self._ids.add(batch_id)

    def round_ended(self) -> None:
        """The round ran all its turns: the next one is planned in plain order."""
        self._ids.clear()

    def for_plan(self, batch_ids: Iterable[int]) -> frozenset[int]:
        """The batches of ``batch_ids`` (the work list now) to plan as served."""
        self._ids = set(self.peek(batch_ids))
        return frozenset(self._ids)

    def peek(self, batch_ids: Iterable[int]) -> frozenset[int]:
        """What :meth:`for_plan` would return now, without keeping it."""
        current = set(batch_ids)
        served = self._ids & current
        if served == current:  # every batch has had its turn: start over
            return frozenset()
        return frozenset(served)


class TurnEnd(Enum):
    """Why a turn ended (:meth:`RoundController.turn_over`)."""

    EMPTIED = "emptied"  # every request of the batch finished or was cancelled
    PREEMPTED = "preempted"  # a hybrid's prefill waits: it goes first (the round is cut)
    CUT = "cut"  # a one-model round and a batch it did not plan for
    QUOTA = "quota"  # the quota is spent


class RoundController:
    """See the module docstring. ``share``: a hybrid instance's decode share
    (:class:`DecodeShare`, fed the instance's prefill seconds at every plan);
    ``None`` on a decode instance (share 1)."""

    def __init__(self, planner: RoundRobinPlanner, *, share: DecodeShare | None = None) -> None:
        self.planner = planner
        self.share = share
        self.served = ServedInRound()
        self.turned: set[int] = set()  # batches that have had a turn (the others are fresh)
        self.plan = RoundPlan((), 0.0, 0.0, 0.0)
        self.turn: Turn | None = None  # the turn in progress
        self.quota_end_s = math.inf  # when the turn's quota is spent (start_quota)
        self.num_rounds = 0
        self._index = -1  # of the turn in progress in plan.turns
        self._open = False  # the round has turns left to run

    # ---- rounds ---------------------------------------------------------
    def plan_round(
        self,
        work: DecodeWorkList,
        latency: LatencyModel,
        context_tokens: Callable[[str], int],
        switch_s: Callable[[str], float],
        *,
        now_s: float,
        prefill_busy_s: float = 0.0,
    ) -> RoundPlan:
        """Start a round (Alg. 2, lines 5-8): regroup ``work`` by model (in place)
        and plan every batch's quota. ``context_tokens(request_id)``: prompt plus
        tokens generated so far; ``switch_s(model)``: the instance's switch
        estimate; ``prefill_busy_s``: a hybrid's cumulative prefill seconds."""
        present = {b.batch_id for b in work}
        self.turned &= present
        share = 1.0 if self.share is None else self.share.observe(now_s, prefill_busy_s)
        self.plan = self.planner.plan_work_list(
            work, latency, context_tokens, turned_ids=self.turned,
            served_ids=self.served.for_plan(present), switch_s=switch_s, decode_share=share,
        )  # fmt: skip
        self.num_rounds += 1
        self.turn, self.quota_end_s = None, math.inf
        self._index, self._open = -1, True
        return self.plan

    def next_turn(self, work: DecodeWorkList, *, prefill_waiting: bool = False) -> Turn | None:
        """At a turn boundary: the turn to run now, or ``None`` when the round is
        over (plan the next one). The round is cut when a prefill waits, or
        when the planner asks for a re-plan (a batch it did not plan for);
        batches emptied since the round was planned are skipped."""
        self.turn, self.quota_end_s = None, math.inf
        if not self._open:
            return None
        if prefill_waiting or (self._index >= 0 and self._replan_due(work, False)):
            self._open = False  # cut: served marks stay for the next plan
            return None
        turns = self.plan.turns
        while True:
            self._index += 1
            if self._index >= len(turns):
                self._open = False
                self.served.round_ended()
                return None
            turn = turns[self._index]
            if work.batch(turn.batch_id) is not None:
                break
        self.turned.add(turn.batch_id)
        self.served.turn_began(turn.batch_id)
        self.turn = turn
        return turn

    # ---- the turn in progress -------------------------------------------
    def start_quota(self, now_s: float) -> float:
        """The turn's model is in place at ``now_s``: its quota runs from now."""
        assert self.turn is not None, "no turn in progress"
        self.quota_end_s = now_s + self.turn.quota_s
        return self.quota_end_s

    def turn_over(
        self,
        work: DecodeWorkList,
        now_s: float,
        *,
        prefill_waiting: bool = False,
    ) -> TurnEnd | None:
        """Between two steps at ``now_s``: why the turn in progress ends, or ``None``."""
        turn = self.turn
        assert turn is not None, "no turn in progress"
        if work.batch(turn.batch_id) is None:
            return TurnEnd.EMPTIED
        if prefill_waiting:
            return TurnEnd.PREEMPTED
        if self._replan_due(work, True):
            return TurnEnd.CUT
        if now_s >= self.quota_end_s - TIME_EPS_S:
            return TurnEnd.QUOTA
        return None

    def following(self, work: DecodeWorkList) -> list[int]:
        """Batch ids in the order their next turns are expected (see the module
        docstring); the turn's own batch is among the last."""
        assert self.turn is not None, "no turn in progress"
        grouped = _grouped(work)
        if self._replan_due(work, False):  # the order the re-plan will give
            served = self.served.peek(b.batch_id for b in grouped)
            loads = [
                BatchLoad(b.batch_id, b.model, 0.0, fresh=b.batch_id not in self.turned,
                          served=b.batch_id in served)
                for b in grouped
            ]  # fmt: skip
            return [b.batch_id for b in self.planner.order(loads)]
        present = {b.batch_id for b in grouped}
        head = [t.batch_id for t in self.plan.turns[self._index + 1 :] if t.batch_id in present]
        listed = set(head)
        return head + [b.batch_id for b in grouped if b.batch_id not in listed]

    def prefetch_model(self, work: DecodeWorkList) -> str | None:
        """The model to load behind the turn in progress: the first in
        :meth:`following` other than the turn's (``None``: nothing to load)."""
        assert self.turn is not None, "no turn in progress"
        for batch_id in self.following(work):
            batch = work.batch(batch_id)
            if batch is not None and batch.model != self.turn.model:
                return batch.model
        return None

    def _replan_due(self, work: DecodeWorkList, mid_turn: bool) -> bool:
        return self.planner.replan_due(self.plan, work.batch_ids, mid_turn=mid_turn)


def _grouped(work: DecodeWorkList) -> list[DecodeBatch]:
    """``work`` as the next round will order it (same-model batches adjacent,
    :meth:`DecodeWorkList.group_by_model`), without reordering it."""
    by_model: dict[str, list[DecodeBatch]] = {}
    for batch in work:
        by_model.setdefault(batch.model, []).append(batch)
    return [b for batches in by_model.values() for b in batches]
