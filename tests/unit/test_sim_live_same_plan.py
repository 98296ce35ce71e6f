"""The simulator's decode instance and a live decode loop run the same round controller,
and given the same arrivals and the same costs they make the same plans and turns.

Live: :class:`~aegaeon_runtime.decode.loop.DecodeLoop` on the in-memory worker
(fake_worker.py), whose engine steps and switches advance a fake clock by the
same latency model the simulator prices them with. Simulated:
:class:`~aegaeon_sim.decode_sim.DecodeSim` with that model as its truth and
no costs besides (no per-step or per-turn overhead, KV copies of no time).
Both refine their estimates from every step and learn switch overheads from
their turns, as they do in service and in a replay.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_sched import LatencyModel, Request, RoundController, RoundRobinPlanner
from aegaeon_sim.decode_sim import DecodeSim
from aegaeon_sim.state import SimRequest
from aegaeon_sim.switching import Eq4Switching, InstanceCosts, switch_cost
from fake_worker import FakeWorker, Outbox, TimedInbox, latency_model

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


def _planner() -> RoundRobinPlanner:
    return RoundRobinPlanner(TBT_S, 4.0, ttft_s=TTFT_S)


Turns = list[tuple[str, float, float, int]]  # model, start, end, steps


def _live(truth: LatencyModel, arrivals: list[Any]) -> tuple[Recording, Turns]:
    switching = Eq4Switching(truth, math.inf)
    worker = FakeWorker(
        truth, ttft_s=TTFT_S, tbt_s=TBT_S, kv_region_bytes=4096 * 8192,  # every batch fits
        switch_s=lambda model, prefetch, now: switch_cost(switching, model, prefetch, now),
    )  # fmt: skip
    timed = [(t, worker.enqueue(rid, m, b, p, n, t)) for t, rid, m, b, p, n in arrivals]
    inbox = TimedInbox(worker.clock, timed)
    rounds = Recording(_planner())
    estimator = LatencyModel.from_dict(truth.to_dict())
    loop = DecodeLoop(worker, inbox, Outbox(), clock=worker.clock, rounds=rounds,
                      profile=lambda: estimator)  # fmt: skip
    loop.run(inbox.stop)
    assert loop.work.num_requests == 0
    turns = [(r.model, r.start_s, r.end_s, r.steps) for r in loop.counters.new_turns if r.steps]
    return rounds, turns


def _simulated(truth: LatencyModel, arrivals: list[Any]) -> tuple[Recording, Turns]:
    rounds = Recording(_planner())
    costs = InstanceCosts(Eq4Switching(truth, math.inf), learned_switch_estimate=True)
    sim = DecodeSim(
        "decode-0", LatencyModel.from_dict(truth.to_dict()), _planner(),
        kv_bytes_per_s=math.inf, costs=costs, rounds=rounds,
        estimator=LatencyModel.from_dict(truth.to_dict()),
    )  # fmt: skip
    sim.meter.refine = True  # as the live loop: every step refines the estimate
    for t, rid, model, batch_id, prompt_len, max_tokens in arrivals:
        while sim.advance(t) is not None:  # a driver's catch-up: finishes on the way
            sim.finished.clear()
        request = Request(rid, model, t, prompt_len, max_tokens, oracle_output_len=max_tokens)
        req = SimRequest(request)
        req.emit(t, 0.0, 1)  # the prefill's token
        req.ready_s = t
        sim.place(req, batch_id, t)
    while sim.advance(math.inf) is not None:
        sim.finished.clear()
    assert not sim.sims
    return rounds, [(model, start, end, steps) for model, start, end, steps, _ in sim.meter.log]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_simulator_and_the_live_loop_make_the_same_plans(seed: int) -> None:
    truth = latency_model(MODELS, switch_s=0.03)
    arrivals = _arrivals(seed)
    (live, live_turns), (sim, sim_turns) = _live(truth, arrivals), _simulated(truth, arrivals)
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
