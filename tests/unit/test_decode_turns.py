"""A decode instance's turns, admission and KV residency on an in-memory worker (fake_worker.py).

The live loop (aegaeon_runtime.decode.DecodeLoop) runs here as it does in a
service, on a fake clock: engine steps and switches advance it by their
modelled times, commands arrive when the clock reaches their times.
"""

from __future__ import annotations

from typing import Any

import pytest
from aegaeon_common.messages.prefill import CancelRequest, EnqueuePrefill, SetModelAwake
from aegaeon_common.messages.report import (
    ModelsResident,
    PrefillDone,
    RequestFailed,
    StepTokens,
    TurnRecord,
)
from aegaeon_common.messages.structs import SamplingParams
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_runtime.port import ModelGoneError, ModelUnavailableError
from aegaeon_sched import DecodeShare, RoundController, RoundRobinPlanner, TurnEnd
from fake_worker import FakeWorker, Outbox, latency_model, run_loop, token_at

STEP_S = 0.005  # one sequence: 4 ms + 1 ms per sequence
SWITCH_S = 0.05


class Recording(RoundController):
    """The controller, keeping every plan and how each turn ended."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[list[tuple[int, str, float]]] = []
        self.ends: list[tuple[int, TurnEnd]] = []

    def plan_round(self, *args: Any, **kwargs: Any) -> Any:
        plan = super().plan_round(*args, **kwargs)
        self.plans.append([(t.batch_id, t.model, t.quota_s) for t in plan.turns])
        return plan

    def turn_over(self, work: Any, now_s: float, **kwargs: Any) -> TurnEnd | None:
        end = super().turn_over(work, now_s, **kwargs)
        if end is not None and self.turn is not None:
            self.ends.append((self.turn.batch_id, end))
        return end


def _run(
    worker: FakeWorker, timed: list[tuple[float, Any]], *, hybrid: bool = False
) -> tuple[DecodeLoop, Outbox]:
    config = worker.config
    planner = RoundRobinPlanner(config.slo.tbt_s, config.scheduler.q_max_s,
                                ttft_s=config.slo.ttft_s,
                                round_ttft_fraction=config.scheduler.round_ttft_fraction)
    rounds = Recording(planner, share=DecodeShare() if hybrid else None)
    return run_loop(DecodeLoop, worker, timed, hybrid, rounds=rounds)


def _tokens(outbox: Outbox) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for msg in outbox.of_type(StepTokens):
        for item in msg.items:
            out.setdefault(item.request_id, []).extend(item.token_ids)
    return out


def _turns(loop: DecodeLoop) -> list[TurnRecord]:
    return list(loop.counters.new_turns)


def test_quota_expiry_ends_a_turn_mid_batch_and_the_next_batch_runs() -> None:
    w = FakeWorker(latency_model(["a", "b"], switch_s=SWITCH_S), tbt_s=0.05)
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 400, 0.0)),
             (0.0, w.enqueue("b1", "b", 1, 20, 400, 0.0))]  # fmt: skip
    loop, outbox = _run(w, timed)
    turns = _turns(loop)
    first = turns[0]
    assert (first.model, first.batch_id) == ("a", 0)
    decode_s = first.end_s - first.start_s - first.switch_s
    # Steps start while the quota lasts: the last one ends past it, by less than a step.
    assert first.quota_s <= decode_s < first.quota_s + STEP_S + 1e-9
    assert first.steps == pytest.approx(first.quota_s / STEP_S, abs=1)
    assert turns[1].model == "b" and turns[2].model == "a"  # round robin
    assert (0, TurnEnd.QUOTA) in loop.rounds.ends  # type: ignore[attr-defined]
    # Every token came, in order, and each request finished once.
    tokens = _tokens(outbox)
    for rid in ("a1", "b1"):
        assert tokens[rid] == [token_at(20 + k) for k in range(399)]
    assert loop.work.num_requests == 0 and not loop.admission.seqs


def test_the_message_that_ends_a_request_carries_what_the_instance_still_holds() -> None:
    """Issue 43: the proxy's stats counted a returned request's KV and sequence until the
    next heartbeat, and until the round ended. Each finish now leaves with a reading
    taken after its KV was freed: what the others still hold, newer each time."""
    w = FakeWorker(latency_model(["a", "b"], switch_s=SWITCH_S), tbt_s=0.05)
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 50, 0.0)),
             (0.0, w.enqueue("a2", "a", 0, 20, 200, 0.0)),
             (0.0, w.enqueue("b1", "b", 1, 20, 120, 0.0))]  # fmt: skip
    loop, outbox = _run(w, timed)
    ends = []
    for msg in outbox.of_type(StepTokens):
        finished = [i.request_id for i in msg.items if i.finish_reason is not None]
        assert (msg.holdings is not None) == bool(finished), msg
        assert msg.kind == "decode"
        if finished:
            ends.append((finished, msg.holdings))
    assert [rids for rids, _ in ends] == [["a1"], ["b1"], ["a2"]]
    readings = [h for _, h in ends]
    assert [h.open_sequences for h in readings] == [2, 1, 0]
    assert [h.version for h in readings] == sorted({h.version for h in readings})
    first, second, last = (h.kv_blocks_in_use for h in readings)
    assert first > second > 0 and last == 0  # a2 and b1, then a2 alone, then nothing
    assert loop.holdings.read().version == readings[-1].version  # the heartbeat's agrees
    assert w.kv.device_bytes_used() == 0


def test_a_request_joins_when_its_own_swap_in_completes() -> None:
    w = FakeWorker(latency_model(["a"]))
    early = w.enqueue("early", "a", 0, 20, 60, 0.0)
    late = w.enqueue("late", "a", 0, 40, 60, 0.0)
    w.kv.ready_at[tuple(late.handoff.block_offsets)] = 0.1  # its copy lands at t = 0.1
    _, outbox = _run(w, [(0.0, early), (0.0, late)])
    # "early" steps alone from the switch's end (t = 0.05) until "late"'s copy lands.
    before = [pos for t, _, pos in w.engine.steps if t < 0.1]
    after = [pos for t, _, pos in w.engine.steps if t >= 0.1]
    assert len(before) == pytest.approx((0.1 - SWITCH_S) / STEP_S, abs=1)
    assert all(len(pos) == 1 and pos[0] < 40 for pos in before)  # early's positions: 20..
    assert after[0] == (20 + len(before), 40)  # late joins at the first step after
    assert _tokens(outbox)["late"][:2] == [token_at(40), token_at(41)]


def test_cancellation_mid_turn_frees_the_request_and_the_turn_goes_on() -> None:
    w = FakeWorker(latency_model(["a"]))  # one model: a turn of 0.7 s (the round bound)
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 300, 0.0)),
             (0.0, w.enqueue("a2", "a", 0, 20, 300, 0.0)),
             (0.2, CancelRequest("a2"))]  # fmt: skip
    loop, outbox = _run(w, timed)
    first = _turns(loop)[0]
    assert first.start_s < 0.2 < first.end_s  # the cancel came mid-turn
    # Both stepped until the first step boundary after t = 0.2, a1 alone after it.
    sizes = [(t, len(pos)) for t, _, pos in w.engine.steps]
    assert all(n == 2 for t, n in sizes if t < 0.2 - STEP_S)
    assert all(n == 1 for t, n in sizes if t >= 0.2)
    tokens = _tokens(outbox)
    assert 0 < len(tokens["a2"]) < 299 and len(tokens["a1"]) == 299
    assert loop.counters.cancelled == 1
    assert w.kv.device_bytes_used() == 0  # every device block came back
    assert set(w.kv.host_freed) == set(w.cache.reassigned)  # and every host block


def test_cancelling_the_whole_batch_ends_its_turn_at_once() -> None:
    w = FakeWorker(latency_model(["a"]))
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 500, 0.0)), (0.1, CancelRequest("a1"))]
    loop, _ = _run(w, timed)
    (turn,) = _turns(loop)
    assert turn.quota_s > 0.5  # quota left, batch gone: the turn ends at the next step
    assert 0.1 <= turn.end_s < 0.1 + STEP_S + 1e-9
    assert loop.rounds.ends == [(0, TurnEnd.EMPTIED)]  # type: ignore[attr-defined]


def test_a_batch_that_does_not_fit_swaps_others_out() -> None:
    # 16 blocks of device KV: each batch holds one request of 150 + 80 tokens
    # (10 to 15 blocks), so only one batch fits at a time.
    w = FakeWorker(latency_model(["a", "b"]), kv_region_bytes=16 * 8192, slab_bytes=8192)
    w.kv.swap_out_order_s = 0.001  # the loop's own time per swap-out: control overhead
    timed = [(0.0, w.enqueue("a1", "a", 0, 150, 80, 0.0)),
             (0.0, w.enqueue("b1", "b", 1, 150, 80, 0.0))]  # fmt: skip
    loop, outbox = _run(w, timed)
    assert len(w.kv.swapped_out) >= 2  # a out for b, then b out for a, ...
    assert loop.residency.num_swap_in >= 3  # a, b, a again (back from the host)
    # each request's timings carry the bookkeeping of its own swaps (Fig. 14's control)
    control = {item.request_id: item.timings.kv_control_s for msg in outbox.of_type(StepTokens)
               for item in msg.items if item.timings is not None}
    assert set(control) == {"a1", "b1"} and all(c >= 0.001 for c in control.values())
    assert sum(control.values()) == pytest.approx(0.001 * len(w.kv.swapped_out))
    tokens = _tokens(outbox)
    assert tokens["a1"] == [token_at(150 + k) for k in range(79)]
    assert tokens["b1"] == [token_at(150 + k) for k in range(79)]
    assert w.kv.device_bytes_used() == 0


def test_a_request_that_can_never_fit_fails_and_the_rest_runs() -> None:
    w = FakeWorker(latency_model(["a"]), kv_region_bytes=16 * 8192, slab_bytes=8192)
    timed = [(0.0, w.enqueue("huge", "a", 0, 400, 10, 0.0)),  # 26 blocks > 16
             (0.0, w.enqueue("grows", "a", 0, 250, 30, 0.0)),  # 16 blocks, then 17
             (0.0, w.enqueue("small", "a", 0, 20, 10, 0.0))]  # fmt: skip
    _, outbox = _run(w, timed)
    failed = {m.request_id: m.code for m in outbox.of_type(RequestFailed)}
    assert failed == {"huge": "kv_capacity", "grows": "kv_capacity"}
    tokens = _tokens(outbox)
    assert len(tokens["small"]) == 9 and "huge" not in tokens
    assert len(tokens["grows"]) == 256 - 250  # until its 257th position needs a 17th block
    assert w.kv.device_bytes_used() == 0


def test_a_new_model_cuts_a_one_model_round_between_two_steps() -> None:
    w = FakeWorker(latency_model(["a", "b"]), q_max_s=4.0, round_ttft_fraction=None)
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 2000, 0.0)),
             (0.5, w.enqueue("b1", "b", 1, 20, 20, 0.5))]  # fmt: skip
    loop, _ = _run(w, timed)
    rounds: Recording = loop.rounds  # type: ignore[assignment]
    assert rounds.plans[0] == [(0, "a", 4.0)]  # one model: Q_MAX, no switch
    first = _turns(loop)[0]
    assert 0.5 <= first.end_s < 0.5 + STEP_S + 1e-9  # cut at the next step, not after 4 s
    assert rounds.ends[0] == (0, TurnEnd.CUT)
    assert [b for b, _, _ in rounds.plans[1]] == [1, 0]  # b has not had a turn: first
    assert _turns(loop)[1].model == "b"


def test_a_hybrids_prefill_preempts_the_decode_turn() -> None:
    # Two batches of one model: turns of 0.35 s each (the round bound), the first
    # from the switch's end at t = 0.05 to 0.4; a prefill arrives at t = 0.3.
    w = FakeWorker(latency_model(["a", "b"]), kind="prefill")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    prefill = EnqueuePrefill("p1", "b", 0, list(range(30)), greedy, 0.3)
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 400, 0.0)),
             (0.0, w.enqueue("a2", "a", 1, 20, 400, 0.0)),
             (0.3, prefill)]  # fmt: skip
    loop, outbox = _run(w, timed, hybrid=True)
    rounds: Recording = loop.rounds  # type: ignore[assignment]
    assert rounds.plans[0] == [(0, "a", pytest.approx(0.35)), (1, "a", pytest.approx(0.35))]
    first = _turns(loop)[0]
    assert first.batch_id == 0 and 0.3 <= first.end_s < 0.3 + STEP_S + 1e-9
    assert rounds.ends[0] == (0, TurnEnd.PREEMPTED)
    (done,) = outbox.of_type(PrefillDone)
    assert done.request_id == "p1" and done.token_id == token_at(29)
    assert w.switcher.activations[:3] == ["a", "b", "a"]  # the prefill's model, then back
    # The next round serves the batch that had no turn first.
    assert [b for b, _, _ in rounds.plans[1]] == [1, 0]
    assert _turns(loop)[1].batch_id == 1


def test_a_hybrid_takes_a_more_urgent_prefill_between_two_queued_ones() -> None:
    # Four batch prefills queued at once, an interactive one arriving while the first
    # runs: it goes next (its group's first-token deadline is earliest), not after the
    # whole backlog (the commands are read between two prefills).
    w = FakeWorker(latency_model(["a"]), kind="prefill")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    batch = [EnqueuePrefill(f"b{k}", "a", 0, list(range(30)), greedy, 0.0, priority=2,
                            ttft_s=50.0) for k in range(4)]  # fmt: skip
    urgent = EnqueuePrefill("i", "a", 1, list(range(30)), greedy, 0.0001, priority=0, ttft_s=5.0)
    _, outbox = _run(w, [*((0.0, m) for m in batch), (0.0001, urgent)], hybrid=True)
    assert [m.request_id for m in outbox.of_type(PrefillDone)] == ["b0", "i", "b1", "b2", "b3"]


@pytest.mark.parametrize("swap_out_s", [0.0, 0.05])
def test_a_hybrids_prefill_swaps_its_decode_sequences_out_instead_of_failing(
    swap_out_s: float,
) -> None:
    # 16 blocks of device KV. A hybrid decodes a batch of two requests of 90 + 30
    # tokens (6 to 8 blocks each): at t = 0.1 they hold 14 blocks. A prefill of
    # 100 tokens (7 blocks) fits the region, not what is free: one decode sequence
    # is swapped out to the host cache to make room (and back in afterwards), the
    # prefill waiting, queued, until that copy has completed (``swap_out_s``), and
    # every request completes. Only a prompt larger than the region (19 blocks) fails.
    w = FakeWorker(latency_model(["a", "b"]), kind="prefill", kv_region_bytes=16 * 8192,
                   slab_bytes=8192)  # fmt: skip
    w.kv.swap_out_s = swap_out_s
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    timed = [(0.0, w.enqueue("a1", "a", 0, 90, 30, 0.0)),
             (0.0, w.enqueue("a2", "a", 0, 90, 30, 0.0)),
             (0.1, EnqueuePrefill("p1", "b", 0, list(range(100)), greedy, 0.1)),
             (0.1, EnqueuePrefill("huge", "b", 1, list(range(300)), greedy, 0.1)),
             (2.0, CancelRequest("nothing"))]  # keeps the inbox open until t = 2 s  # fmt: skip
    loop, outbox = _run(w, timed, hybrid=True)
    failed = {m.request_id: m.code for m in outbox.of_type(RequestFailed)}
    assert failed == {"huge": "kv_capacity"}
    (done,) = outbox.of_type(PrefillDone)
    assert done.request_id == "p1" and done.token_id == token_at(99)
    assert loop.residency.num_swap_out >= 1  # made room by swapping a decode sequence out
    tokens = _tokens(outbox)
    assert tokens["a1"] == [token_at(90 + k) for k in range(29)]
    assert tokens["a2"] == [token_at(90 + k) for k in range(29)]
    w.kv.pool.reclaim()
    assert w.kv.device_bytes_used() == 0


def test_sleep_waits_for_the_models_work_and_wake_prefetches_while_busy() -> None:
    """SetModelAwake between two steps: a model with a batch here stays on the device
    (its turn needs it); another model is prefetched while the instance is busy; once
    idle, a sleep takes the model off and a wake switches it in."""
    w = FakeWorker(latency_model(["a", "b"]))
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 60, 0.0)),
             (0.1, SetModelAwake("a", False, 1)),  # mid-turn: a1 needs it
             (0.1, SetModelAwake("b", True, 2)),  # busy: prefetched behind "a"
             (5.0, SetModelAwake("a", False, 3)),  # idle now: off the device
             (6.0, SetModelAwake("a", True, 4))]  # idle: switched in now
    _, outbox = _run(w, timed)
    answers = {m.ticket: m.resident_models for m in outbox.of_type(ModelsResident)}
    assert answers == {1: ["a"], 2: ["a", "b"], 3: ["b"], 4: ["a"]}
    assert w.switcher.activations == ["a", "a"]
    assert len(_tokens(outbox)["a1"]) == 59  # the request ran to its end
    versions = [m.residency_version for m in outbox.of_type(ModelsResident)]
    assert versions == sorted(versions) and versions[0] < versions[-1]


def _forget(worker: FakeWorker, model: str,
            error: type[ModelGoneError] = ModelGoneError) -> None:  # fmt: skip
    """``model`` is gone from the node's cachemgr (removed through another replica), or
    unreadable there (``ModelUnavailableError``): switching to it is refused as the
    cachemgr refuses it."""
    activate = worker.switcher.activate

    def refusing(name: str, now_s: float | None = None) -> Any:
        if name == model:
            raise error(name, "the cachemgr refuses it")
        return activate(name, now_s)

    worker.switcher.activate = refusing  # type: ignore[method-assign]


@pytest.mark.parametrize(("error", "code"), [(ModelGoneError, "unknown_model"),
                                             (ModelUnavailableError, "model_unavailable")])
def test_a_batch_of_a_model_the_cachemgr_refuses_fails_and_the_instance_goes_on(
    error: type[ModelGoneError], code: str
) -> None:
    w = FakeWorker(latency_model(["a", "b"]))
    _forget(w, "b", error)
    timed = [(0.0, w.enqueue("b1", "b", 1, 20, 10, 0.0)),
             (0.0, w.enqueue("a1", "a", 0, 20, 10, 0.0))]  # fmt: skip
    loop, outbox = _run(w, timed)
    failed = {m.request_id: m.code for m in outbox.of_type(RequestFailed)}
    assert failed == {"b1": code}
    assert len(_tokens(outbox)["a1"]) == 9
    assert loop.work.num_requests == 0 and not loop.admission.seqs


@pytest.mark.parametrize("policy", ["request-level-charged", "request-level", "aegaeon"])
def test_a_charged_baseline_waits_out_its_load_path_at_every_scale_up(policy: str) -> None:
    """``request-level-charged``: a scale-up takes ``init_s + bytes / load_gb_s`` (the
    paper's ServerlessLLM) whatever this system's switch took, the rest waited out on the
    instance and recorded (``charged_s``); every other policy pays its switch alone."""
    from aegaeon_common.config import BaselineConfig
    from aegaeon_engine import weight_layout

    baseline = BaselineConfig(load_gb_s=0.001, init_s=0.25)  # 1 MB/s: seconds a scale-up
    w = FakeWorker(latency_model(["a", "b"], switch_s=SWITCH_S), policy=policy,
                   baseline=baseline)  # fmt: skip
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 5, 0.0)),
             (0.0, w.enqueue("b1", "b", 1, 20, 5, 0.0))]  # fmt: skip
    loop, outbox = _run(w, timed)
    assert set(_tokens(outbox)) == {"a1", "b1"}
    records = list(loop.counters.new_switches)
    assert [r.to_model for r in records] == ["a", "b"]
    nbytes = weight_layout(w.specs["a"], w.config.dtype).total_bytes
    scale_up_s = 0.25 + nbytes / 1e6
    turns = {t.model: t for t in _turns(loop)}
    for record in records:
        if policy == "request-level-charged":
            assert record.total_s == pytest.approx(scale_up_s)
            assert record.charged_s == pytest.approx(scale_up_s - SWITCH_S)
            assert turns[record.to_model].switch_s >= scale_up_s - 1e-9  # on the clock
        else:
            assert record.charged_s == 0.0 and record.total_s == pytest.approx(SWITCH_S)
