"""Which batches have had a turn since the last decode round that ran to its end.

A decode instance's round can be cut short (Algorithm 2, re-planned): on a
hybrid instance a queued prefill runs first, and a one-model round ends when
another model's batch arrives. The next round is planned afresh with the
batches that have had a turn since the last complete round marked
:attr:`~aegaeon_sched.BatchLoad.served`, so the planner
(:meth:`~aegaeon_sched.RoundRobinPlanner.order`) serves the others first. Cut
after cut, every batch still gets its turn in work-list order; once all of
them have had one, the count starts over. Without this book every re-plan
would restart from the head of the work list and a batch at its tail could
wait as long as the interruptions keep coming (on the CPU node: 1.3 s behind
a stream of prefills). The live decode loop and the simulator keep it the
same way.
"""

from __future__ import annotations

from collections.abc import Iterable


class ServedInRound:
    """See the module docstring."""

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def turn_began(self, batch_id: int) -> None:
        self._ids.add(batch_id)

    def round_ended(self) -> None:
        """The round ran all its turns: the next one is planned in plain order."""
        self._ids.clear()

    def for_plan(self, batch_ids: Iterable[int]) -> frozenset[int]:
        """The batches of ``batch_ids`` (the work list now) to plan as served."""
        current = set(batch_ids)
        self._ids &= current
        if self._ids == current:  # every batch has had its turn: start over
            self._ids.clear()
        return frozenset(self._ids)
