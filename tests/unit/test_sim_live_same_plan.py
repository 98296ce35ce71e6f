"""The simulator runs the live decode loop itself; on its event loop the loop makes the same
plans and turns, at the same times, as when a test drives it alone on a plain fake clock.

Alone: :class:`~aegaeon_runtime.decode.loop.DecodeLoop` on the in-memory worker
(fake_worker.py), its commands delivered by a :class:`TimedInbox`. Simulated: the same
loop as a task of :class:`~aegaeon_sim.events.EventLoop` (its engine steps and
switches pause it on simulated time, its inbox is a :class:`~aegaeon_sim.instances.SimInbox`
filled by events at the arrival times), as every instance of ``aegaeon sim`` runs.
Both refine their estimates from every step and learn switch overheads from their
turns, as they do in service.
"""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import pytest
from aegaeon_common.wire import Message
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_sched import LatencyModel, RoundController, RoundRobinPlanner
from aegaeon_sim.events import EventLoop, SimClock
from aegaeon_sim.instances import SimInbox
from aegaeon_sim.switching import Eq4Switching, switch_cost
from fake_worker import FakeWorker, Outbox, latency_model, run_loop

MODELS = ["a", "b", "c"]
TTFT_S, TBT_S = 1.0, 0.05


class Recording(RoundController):
    """The controller, keeping every plan and every turn it names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[list[tuple[int, str, float]]] = []
        self.turns: list[tuple[int, float]] = []

    def plan_round(self, *args: Any, **kwargs: Any) -> Any:
        plan = super().plan_round(*args, **kwargs)
        self.plans.append([(t.batch_id, t.model, t.quota_s) for t in plan.turns])
        return plan

    def next_turn(self, *args: Any, **kwargs: Any) -> Any:
        turn = super().next_turn(*args, **kwargs)
        if turn is not None:
            self.turns.append((turn.batch_id, turn.quota_s))
        return turn


def _arrivals(seed: int) -> list[tuple[float, str, str, int, int, int]]:
    """(time, request id, model, batch id, prompt tokens, max tokens): one model
    alone at first (one-model rounds, cut when the second arrives), then three,
    batches joined mid-turn and new batches mid-round."""
    rng = random.Random(seed)
    out = []
    batch_of = {"a": 0, "b": 1, "c": 2}
    t = 0.0
    for i in range(40):
        model = "a" if i < 4 else rng.choice(MODELS)
        t += rng.uniform(0.01, 0.12)
        out.append((t, f"r{i}", model, batch_of[model], rng.randint(10, 120),
                    rng.randint(20, 160)))  # fmt: skip
    return out


Turns = list[tuple[str, float, float, int]]  # model, start, end, steps


def _run(truth: LatencyModel, arrivals: list[Any], simulated: bool) -> tuple[Recording, Turns]:
    switching = Eq4Switching(truth, math.inf)
    events = EventLoop()
    worker = FakeWorker(
        truth, SimClock(events) if simulated else None, ttft_s=TTFT_S, tbt_s=TBT_S,
        kv_region_bytes=4096 * 8192,  # every batch fits
        switch_s=lambda model, prefetch, now: switch_cost(switching, model, prefetch, now),
    )  # fmt: skip
    timed = [(t, worker.enqueue(rid, m, b, p, n, t)) for t, rid, m, b, p, n in arrivals]
    rounds = Recording(RoundRobinPlanner(TBT_S, 4.0, ttft_s=TTFT_S))
    estimator = LatencyModel.from_dict(truth.to_dict())
    if simulated:
        inbox = SimInbox(events)
        loop = DecodeLoop(worker, inbox, Outbox(), clock=worker.clock, rounds=rounds,
                          profile=lambda: estimator)  # fmt: skip
        inbox.idle = lambda: not len(loop.work)
        for t, msg in timed:
            events.at(t, lambda msg=msg: inbox.put(msg))  # type: ignore[misc]
        events.spawn(lambda: loop.run(threading.Event()))
        events.run(math.inf)  # until the loop waits for a command that never comes
        events.close()
    else:
        loop, _ = run_loop(DecodeLoop, worker, timed, rounds=rounds)
    assert loop.work.num_requests == 0
    turns = [(r.model, r.start_s, r.end_s, r.steps) for r in loop.counters.new_turns if r.steps]
    return rounds, turns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_simulator_drives_the_loop_as_a_plain_fake_clock_does(seed: int) -> None:
    truth = latency_model(MODELS, switch_s=0.03)
    arrivals = _arrivals(seed)
    (live, live_turns), (sim, sim_turns) = (_run(truth, arrivals, False),
                                            _run(truth, arrivals, True))  # fmt: skip
    assert len(live.plans) > 10 and len({len(p) for p in live.plans}) > 1
    assert any(quota == 4.0 or len(plan) == 1 for plan in live.plans for *_, quota in plan)
    assert [[(b, m) for b, m, _ in p] for p in sim.plans] == [
        [(b, m) for b, m, _ in p] for p in live.plans
    ]
    for sim_plan, live_plan in zip(sim.plans, live.plans, strict=True):
        assert [q for *_, q in sim_plan] == pytest.approx([q for *_, q in live_plan], rel=1e-9)
    assert [b for b, _ in sim.turns] == [b for b, _ in live.turns]
    assert [q for _, q in sim.turns] == pytest.approx([q for _, q in live.turns], rel=1e-9)
    # ... and the turns take the same time: switches (prefetched or not) and steps.
    assert [(m, n) for m, _, _, n in sim_turns] == [(m, n) for m, _, _, n in live_turns]
    assert [t for _, s, e, _ in sim_turns for t in (s, e)] == pytest.approx(
        [t for _, s, e, _ in live_turns for t in (s, e)], abs=1e-9
    )


def test_an_idle_loop_waits_for_a_command_and_a_busy_one_for_its_timeout() -> None:
    """The inbox of a simulated instance: an idle loop sleeps until a command comes (no
    polling events), a loop with work waits only its timeout (a copy may complete)."""
    events = EventLoop()
    inbox = SimInbox(events)
    busy = [False]
    inbox.idle = lambda: not busy[0]
    seen: list[tuple[float, int]] = []

    def task() -> None:
        got = inbox.wait(0.05)
        seen.append((events.now, len(got)))
        busy[0] = True
        got = inbox.wait(0.05)
        seen.append((events.now, len(got)))

    marker: list[Message] = [Outbox()]  # type: ignore[list-item]
    events.at(3.0, lambda: inbox.put(marker[0]))
    events.spawn(task)
    events.run(10.0)
    assert seen == [(3.0, 1), (3.05, 0)]
