"""Rounds cut short: every batch still gets its turn (aegaeon_sched.rounds)."""

from __future__ import annotations

from aegaeon_sched import BatchLoad, RoundRobinPlanner, ServedInRound


def _first_turns(book: ServedInRound | None, rounds: int) -> list[int]:
    """Plan ``rounds`` rounds over batches 0-3 (four models), each cut after its
    first turn (a prefill arrives on the hybrid instance every time)."""
    planner = RoundRobinPlanner(0.1, 4.0)
    switch = dict.fromkeys("abcd", 0.01)
    firsts = []
    for _ in range(rounds):
        served = book.for_plan(range(4)) if book is not None else frozenset()
        loads = [BatchLoad(i, "abcd"[i], 0.01, served=i in served) for i in range(4)]
        first = planner.plan(loads, switch).turns[0].batch_id
        if book is not None:
            book.turn_began(first)
        firsts.append(first)
    return firsts


def test_cut_rounds_still_serve_every_batch_in_turn() -> None:
    assert _first_turns(ServedInRound(), 9) == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    # Re-planned in plain work-list order, the head batch takes every turn.
    assert _first_turns(None, 9) == [0] * 9


def test_a_complete_round_starts_the_count_over() -> None:
    book = ServedInRound()
    book.turn_began(0)
    book.turn_began(1)
    assert book.for_plan([0, 1, 2]) == {0, 1}
    book.round_ended()
    assert book.for_plan([0, 1, 2]) == frozenset()


def test_batches_that_left_are_forgotten() -> None:
    book = ServedInRound()
    for batch_id in (0, 1, 2):
        book.turn_began(batch_id)
    # Batch 2 finished; 3 is new: 0 and 1 have had their turn, 3 has not.
    assert book.for_plan([0, 1, 3]) == {0, 1}
    book.turn_began(3)
    assert book.for_plan([0, 1, 3]) == frozenset()  # all had one: start over
