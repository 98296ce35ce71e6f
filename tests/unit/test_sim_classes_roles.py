"""Issue 19 in the simulator: class mixes, ON/OFF bursts, admission with shedding by
class, attainment per class, role switching (small traces, exact or bounded outcomes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from aegaeon_sched import (
    Reject,
    Request,
    RequestTrace,
    Shedder,
    SLOClasses,
)
from aegaeon_sched.admission import Bounds
from aegaeon_sim.classes import AdmissionGate, reports_by_class, resolve
from aegaeon_sim.roles_feed import Sample, absorb_times
from aegaeon_sim.runner import Scenario, run_scenario
from aegaeon_workload.mix import (
    Burst,
    assign_classes,
    class_of,
    generate_bursty,
    parse_burst,
    parse_mix,
)
from aegaeon_workload.synthetic import WorkloadSpec, generate

MIX = (("interactive", 0.3), ("batch", 0.7))


def test_parse_mix_normalises_and_rejects_bad_names() -> None:
    mix = parse_mix("interactive=3,batch=7")
    assert [n for n, _ in mix] == ["interactive", "batch"]
    assert [v for _, v in mix] == pytest.approx([0.3, 0.7])
    for bad in ("urgent=1", "interactive", "batch=0", "batch=1,batch=2"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_classes_depend_only_on_seed_and_id() -> None:
    requests = generate(WorkloadSpec(("a", "b"), 2.0, 100.0, seed=3))
    classes = assign_classes(requests, MIX, 3)
    assert classes == {r.request_id: class_of(r.request_id, MIX, 3) for r in requests}
    assert assign_classes(requests[:10], MIX, 3) == {r.request_id: classes[r.request_id]
                                                     for r in requests[:10]}  # fmt: skip
    share = sum(c == "interactive" for c in classes.values()) / len(classes)
    assert 0.22 < share < 0.38  # ~400 draws of 0.3


def test_burst_shape_and_trace() -> None:
    burst = parse_burst("on=2,period=10,factor=5,first=3")
    assert burst == Burst(2.0, 10.0, 5.0, 3.0)
    assert [burst.is_on(t) for t in (0, 2.9, 3.0, 4.9, 5.0, 13.5)] == [
        False, False, True, True, False, True]  # fmt: skip
    assert burst.starts(30) == [3.0, 13.0, 23.0]
    assert burst.mean_factor() == pytest.approx((2 * 5 + 8) / 10)
    spec = WorkloadSpec(("a", "b"), 1.0, 60.0, seed=1)
    bursty = generate_bursty(spec, burst)
    peak = generate(replace(spec, rps_per_model=5.0))
    on = [r for r in peak if burst.is_on(r.arrival_s)]
    assert [r for r in bursty if burst.is_on(r.arrival_s)] == on  # ON: the peak trace itself
    off = [r for r in bursty if not burst.is_on(r.arrival_s)]
    assert 0.6 * 2 * 48 < len(off) < 1.4 * 2 * 48  # thinned to the base rate (48 s OFF)
    assert generate_bursty(spec, burst) == bursty


def test_resolve_gives_each_request_its_class_targets() -> None:
    classes = SLOClasses.default(10.0, 0.1)
    reqs = [Request("x", "m", 0.0, 10, 5, 5), Request("y", "m", 1.0, 10, 5, 5)]
    out = resolve(reqs, classes, {"x": "interactive", "y": "batch"})
    assert (out[0].priority, out[0].ttft_s, out[0].tbt_s) == (0, 5.0, 0.1)
    assert (out[1].priority, out[1].ttft_s, out[1].tbt_s) == (2, 50.0, 0.4)


def test_reports_by_class_score_each_class_against_its_own_targets() -> None:
    classes = SLOClasses.default(10.0, 0.1)
    # first token at 8 s, then every 0.3 s: late for interactive (5 s, 0.1 s), on time for batch
    times = [8.0 + 0.3 * k for k in range(4)]
    traces = [RequestTrace("i", 0.0, 4, times), RequestTrace("b", 0.0, 4, times)]
    reps = reports_by_class(traces, classes, {"i": "interactive", "b": "batch"})
    assert reps["interactive"].tokens_met == 0
    assert reps["batch"].tokens_met == 4
    assert set(reps) == {"interactive", "batch"}


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.arrived: list[str] = []

    def on_arrival(self, request: Request, now_s: float) -> list:
        self.arrived.append(request.request_id)
        return []

    def on_prefill_started(self, instance: str, request_id: str, now_s: float) -> list:
        return []

    def on_prefill_done(self, instance: str, request_id: str, m: float, now_s: float) -> list:
        return []

    def on_request_finished(self, request_id: str, now_s: float) -> list:
        return []

    def on_request_cancelled(self, request_id: str, now_s: float) -> list:
        return []


def _req(rid: str, rank: int, prompt: int = 100, arrival: float = 0.0) -> Request:
    ttft = (5.0, 10.0, 50.0)[rank]
    return Request(rid, "m", arrival, prompt, 1, 1, priority=rank, ttft_s=ttft)


def test_gate_sheds_the_lowest_class_first_and_releases_deferred() -> None:
    classes = SLOClasses.default(10.0, 0.1)
    inner = _Recorder()
    names = {"b1": "batch", "b2": "batch", "i1": "interactive", "i2": "interactive",
             "i3": "interactive"}  # fmt: skip
    gate = AdmissionGate(inner, Bounds(prefill_tokens=300), Shedder(classes), names)
    assert gate.on_arrival(_req("b1", 2), 0.0) == []  # nothing held: admitted
    assert gate.on_arrival(_req("b2", 2), 0.0) == []  # 200 > 0.5 x 300: deferred
    assert gate.on_arrival(_req("i1", 0), 0.0) == []  # 200 <= 1.25 x 300
    assert gate.on_arrival(_req("i2", 0), 0.0) == []  # 300 <= 375
    last = gate.on_arrival(_req("i3", 0), 0.0)  # 400 > 375: refused (interactive never waits)
    assert len(last) == 1 and isinstance(last[0], Reject)
    assert inner.arrived == ["b1", "i1", "i2"]
    snap = gate.snapshot()
    assert snap["deferred"] == {"batch": 1} and snap["refused"] == {"interactive": 1}
    gate.on_prefill_done("p", "i1", 0.0, 1.0)  # 200 held: 300 > 150, b2 still waits
    assert inner.arrived[-1] == "i2"
    gate.on_request_finished("b1", 2.0)
    gate.on_request_finished("i2", 3.0)  # 0 held: the deferred batch request goes
    assert inner.arrived[-1] == "b2"
    assert gate.defer_wait_s == [3.0]


def test_gate_single_slo_refuses_past_the_bounds() -> None:
    inner = _Recorder()
    gate = AdmissionGate(inner, Bounds(prefill_tokens=250))
    assert gate.on_arrival(_req("a", 1), 0.0) == []
    assert gate.on_arrival(_req("b", 1), 0.0) == []
    out = gate.on_arrival(_req("c", 1), 0.0)
    assert isinstance(out[0], Reject) and inner.arrived == ["a", "b"]


def test_absorb_times() -> None:
    samples = [Sample(t / 2, b, 1, 0.0) for t, b in enumerate(
        [0, 0, 0, 0, 9000, 12000, 6000, 3000, 1000, 0, 0, 0, 100, 100])]  # fmt: skip
    out = absorb_times(samples, [2.0, 6.0], slack_tokens=2048)
    assert out[0].peak_backlog_tokens == 12000
    assert out[0].absorbed_s == pytest.approx(2.0)  # 1000 <= 2048 at t=4.0
    assert out[1].absorbed_s == 0.0  # never rose past the level
    never = absorb_times(samples[:7], [2.0], slack_tokens=2048)
    assert never[0].absorbed_s is None


SMALL = Scenario("aegaeon", 4, 1.0, duration_s=20.0, drain_s=200.0, num_prefill=2, num_decode=2)


def test_sim_multi_slo_scores_per_class_and_is_deterministic() -> None:
    sc = replace(SMALL, class_mix=MIX, admission=True)
    a, b = run_scenario(sc), run_scenario(sc)
    assert a.by_class == b.by_class and a.admission == b.admission
    assert set(a.by_class) == {"interactive", "batch"}
    assert sum(r.num_requests for r in a.by_class.values()) == a.report.num_requests
    single = run_scenario(replace(sc, slo_classes=False))
    assert {k: v.num_requests for k, v in single.by_class.items()} == {
        k: v.num_requests for k, v in a.by_class.items()}  # fmt: skip
    # light load: nothing shed, everything finishes
    assert a.report.num_failed == a.report.num_unfinished == 0


def test_sim_roles_move_on_a_burst_and_lose_nothing() -> None:
    burst = Burst(on_s=4.0, period_s=15.0, factor=20.0, first_s=3.0)
    sc = replace(SMALL, rps_per_model=0.3, burst=burst)
    fixed = run_scenario(sc)
    dynamic = run_scenario(replace(sc, roles=True))
    assert fixed.role_changes == 0 and dynamic.role_changes >= 1
    assert len(fixed.absorb) == len(dynamic.absorb) == 2
    for r in (fixed, dynamic):
        assert r.report.num_requests == fixed.report.num_requests
        assert r.report.num_failed == r.report.num_unfinished == 0  # no request lost
    assert max(s.prefill_role for s in dynamic.samples) > 2
    assert all(s.prefill_role == 2 for s in fixed.samples)


def test_bench_serve_plans_the_simulators_classes_and_bursts() -> None:
    from aegaeon_bench.node.client import completion_body
    from aegaeon_workload.plan import ModelLimits, plan_requests

    limits = {m: ModelLimits(256, 4096, "default") for m in ("a", "b")}
    burst = Burst(2.0, 10.0, 5.0, 3.0)
    planned = plan_requests(("a", "b"), limits, rps_per_model=1.0, duration_s=30.0, seed=2,
                            mix=MIX, burst=burst)  # fmt: skip
    spec = WorkloadSpec(("a", "b"), 1.0, 30.0, seed=2, context_limits=(4096, 4096))
    sim = generate_bursty(spec, burst)
    assert [p.request_id for p in planned] == [r.request_id for r in sim]
    assert all(p.priority == class_of(p.request_id, MIX, 2) for p in planned)
    assert completion_body(planned[0])["priority"] == planned[0].priority
    plain = plan_requests(("a",), limits, rps_per_model=1.0, duration_s=5.0, seed=2)
    assert "priority" not in completion_body(plain[0])


def test_bench_serve_scores_each_class_against_its_targets() -> None:
    from aegaeon_bench.report.metrics import by_class
    from aegaeon_sched import SLO
    from aegaeon_workload.trace import TraceRecord

    times = tuple(8.0 + 0.3 * k for k in range(4))
    records = [TraceRecord(rid, "m", 0.0, times, 4, "ok") for rid in ("i", "b")]
    out = by_class(records, {"i": "interactive", "b": "batch"}, SLO(10.0, 0.1))
    assert out["interactive"]["tokens_met"] == 0 and out["batch"]["tokens_met"] == 4
