"""The paper scenario's pure parts: the model mix, the device layout, the rate plan (from the
prediction, interleaved, fitted to the time), the sustainable rate and its ratio, and what a
run's files say."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from aegaeon_bench.gpu_check import paper as gpu_check_paper
from aegaeon_bench.gpu_check.models import (
    GPU_INSTANCE_MARGIN_BYTES,
    GPU_KV_MIN_BYTES,
    GPU_USABLE_FRACTION,
    PREFERRED,
    MachineFacts,
    choose_models,
    gpu_model_cap,
    instance_layout,
    presets,
    weight_bytes,
)
from aegaeon_bench.gpu_check.paper_plan import (
    PolicyRates,
    choose_rates,
    extend,
    fit_budget,
    node_starts,
    order_runs,
    rate_grid,
)
from aegaeon_bench.gpu_check.paper_stats import (
    capacity_unit,
    engine_costs,
    rate_ratio,
    run_files,
    run_point,
    sustainable_rate,
)
from aegaeon_workload.synthetic import SHAREGPT_INPUT, SHAREGPT_OUTPUT

GB = 10**9
GiB = 1 << 30
SIZES = {name: weight_bytes(p, "fp8") for name, p in presets("full").items()}


def facts(ram: float = 128 * GiB, shm: float = 96 * GiB, gpu: float | None = 80 * GB,
          generate: float = 4 * GB) -> MachineFacts:
    return MachineFacts(int(ram), int(shm), None if gpu is None else int(gpu), generate)


def fits_device(presets: tuple[str, ...], gpu_free: int) -> bool:
    layout = instance_layout([SIZES[p] for p in presets], gpu_free)
    per_instance = layout.device_memory_bytes + GPU_INSTANCE_MARGIN_BYTES
    return layout.kv_memory_bytes >= GPU_KV_MIN_BYTES and \
        2 * per_instance <= GPU_USABLE_FRACTION * gpu_free + 1


def test_eight_8b_models_in_fp8_fit_an_h100_host() -> None:
    """The issue's machine (128 GiB of RAM, one H100): eight 7-8B models in FP8, each
    twice per instance beside its KV region."""
    assert round(SIZES["llama-3.1-8b"] / GB, 2) == 9.09  # as the H100 run packed it
    assert all(7 * GB < SIZES[p] < 10 * GB for p in PREFERRED) and len(PREFERRED) == 8
    choice = choose_models(facts(), SIZES, 30.0)
    assert choice.presets == PREFERRED
    assert choice.downgrades == choice.dropped == 0
    assert choice.total_bytes == sum(SIZES[p] for p in PREFERRED) <= choice.cap_bytes
    assert fits_device(choice.presets, 80 * GB)


@pytest.mark.parametrize("ram,shm,generate,binding", [
    (96 * GiB, 96 * GiB, 4 * GB, "host_ram"),
    (128 * GiB, 64 * GiB, 4 * GB, "shm"),  # a 64 GiB /dev/shm: the smaller 7B models
    (128 * GiB, 96 * GiB, 2 * GB, "generation"),  # a node start generates them: <= 30 s
])  # fmt: skip
def test_every_rule_bounds_the_weights(ram: float, shm: float, generate: float,
                                       binding: str) -> None:
    choice = choose_models(facts(ram, shm, 80 * GB, generate), SIZES, 30.0)
    assert choice.binding == binding
    assert 0 < choice.total_bytes <= choice.cap_bytes
    assert choice.cap_bytes == min(choice.caps.values())
    # shrunk, not dropped: still eight models
    assert len(choice.presets) == len(PREFERRED) and choice.dropped == 0
    assert choice.downgrades > 0
    assert fits_device(choice.presets, 80 * GB)


def test_the_device_caps_each_model() -> None:
    gpu = 24 * GB  # an A10: no 3B model fits twice in each of two instances
    cap = gpu_model_cap(gpu)
    assert cap is not None and cap < SIZES["llama-3.2-3b"]
    choice = choose_models(facts(gpu=gpu), SIZES, 30.0)
    assert choice.gpu_model_cap_bytes == cap
    assert all(SIZES[p] <= cap for p in choice.presets) and len(choice.presets) == 8
    assert fits_device(choice.presets, gpu)


def test_models_are_dropped_only_when_all_are_the_smallest() -> None:
    smallest = min(SIZES, key=lambda p: SIZES[p])
    room = 3.5 * SIZES[smallest]
    choice = choose_models(facts(ram=room / 0.6), SIZES, 30.0)
    assert choice.presets == (smallest,) * 3 and choice.dropped == 5
    nothing = choose_models(facts(shm=0), SIZES, 30.0)
    assert nothing.presets == () and nothing.total_bytes == 0


def test_a_cpu_has_no_device_cap_and_max_models_truncates() -> None:
    choice = choose_models(facts(gpu=None), SIZES, 30.0, max_models=4)
    assert choice.gpu_model_cap_bytes is None and choice.presets == PREFERRED[:4]


def test_layouts_hold_two_of_the_largest_under_the_serve_cap() -> None:
    """The scenario serves with ``--device-memory`` = the layout's device memory; the
    cap's rule (``split_buffer``) then keeps two of the largest model in the arena."""
    from aegaeon_sched.sizing import kv_min_bytes, split_buffer

    for weights, gpu in (([100 << 20, 160 << 20], None), ([40 << 20], None),
                         ([SIZES["qwen3-8b"], SIZES["mistral-7b-v0.3"]], 80 * GB)):
        layout = instance_layout(weights, gpu)
        split = split_buffer(layout.device_memory_bytes, max(weights),
                             kv_min_bytes("cpu" if gpu is None else "cuda:0"))
        assert split is not None and split.prefetch_room, (weights, layout)
        assert split.weights_bytes >= 2 * max(weights)
        assert layout.model_cache_bytes >= sum(weights)


def test_the_grid_is_geometric_around_the_unit() -> None:
    grid = rate_grid(0.04)
    assert grid[0] == pytest.approx(0.005) and grid[-1] == pytest.approx(0.32)
    assert all(b / a == pytest.approx(2**0.5) for a, b in itertools.pairwise(grid))
    with pytest.raises(ValueError):
        rate_grid(0.0)


GRID = [0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0]


def curve(crossing: float, cap: float = 1.0) -> list[tuple[float, float]]:
    """A predicted curve: ``cap`` below ``crossing``, falling fast above it."""
    return [(r, cap if r <= crossing else max(0.0, cap - (r - crossing))) for r in GRID]


def test_rates_bracket_each_predicted_crossing() -> None:
    chosen = choose_rates("aegaeon", curve(2.1))
    assert chosen.rates == (2.0, 2.8) and chosen.extend
    assert choose_rates("aegaeon", curve(2.1), points=3).rates == (1.4, 2.0, 2.8)
    assert choose_rates("aegaeon", curve(2.1), points=1).rates == (2.0,)
    assert choose_rates("x", curve(0.4), points=3).rates == (0.5, 0.7, 1.0)  # misses at once
    held = choose_rates("x", curve(9.0))
    assert held.rates == (2.8, 4.0) and "every grid rate" in held.why
    noisy = [(0.5, 0.85), (0.7, 0.95), *curve(0.9)[2:]]  # under 90% at the lowest rate
    low = choose_rates("x", noisy)
    assert low.rates == (0.5, 0.7) and "lowest" in low.why
    never = choose_rates("static-mux", curve(9.0, cap=0.5))
    assert never.rates == (0.5,) and not never.extend and "never" in never.why


def test_runs_interleave_rate_by_rate_and_carry_on_with_the_node_that_is_up() -> None:
    rates = {"aegaeon": [2.0, 2.8], "charged": [1.0, 1.4], "request-level": [1.0, 1.4],
             "static-mux": [0.5]}  # fmt: skip
    priority = ["aegaeon", "charged", "request-level", "static-mux"]
    order = order_runs(rates, priority, first="aegaeon")
    assert [r for _, r in order] == sorted(r for _, r in order)  # rate by rate
    assert sorted(order) == sorted((p, r) for p, rs in rates.items() for r in rs)
    # at 1.0 both baselines run back to back; the one that started 1.0 ends it, the other
    # starts 1.4 on the node that is up
    assert order == [("static-mux", 0.5), ("charged", 1.0), ("request-level", 1.0),
                     ("request-level", 1.4), ("charged", 1.4), ("aegaeon", 2.0),
                     ("aegaeon", 2.8)]  # fmt: skip
    assert node_starts(order, first="aegaeon") == 5
    assert node_starts(order_runs({"a": [1.0]}, ["a"], first="a"), first="a") == 0


def test_the_plan_fits_the_time_by_leaving_out_what_matters_least() -> None:
    chosen = [PolicyRates("aegaeon", (1.4, 2.0, 2.8), ""),
              PolicyRates("charged", (0.7, 1.0, 1.4), ""),
              PolicyRates("request-level", (0.7, 1.0), ""),
              PolicyRates("static-mux", (0.5,), "")]  # fmt: skip

    def run_s(policy: str, rate: float) -> float:
        return 90.0  # 60 s of arrivals + 30 s of grace

    everything = fit_budget(chosen, run_s, 30.0, 10_000.0, first="aegaeon")
    assert sum(map(len, everything.rates.values())) == 9 and not everything.left_out
    assert everything.estimate_s == 9 * 90.0 + node_starts(everything.order, "aegaeon") * 30
    tight = fit_budget(chosen, run_s, 30.0, 600.0, first="aegaeon")
    assert tight.estimate_s <= 600.0
    assert tight.rates["aegaeon"] == (2.0, 2.8) and tight.rates["charged"] == (1.0, 1.4)
    assert set(tight.left_out) == {"request-level", "static-mux"}
    assert "--paper-policies" in tight.left_out["static-mux"]
    alone = fit_budget(chosen, run_s, 30.0, 100.0, first="aegaeon")
    assert list(alone.rates) == ["aegaeon"] and alone.rates["aegaeon"] == (2.8,)


def test_a_measured_crossing_is_bracketed_by_extending() -> None:
    assert extend({2.0: 0.95, 2.8: 0.5}, GRID, 3) is None  # bracketed
    assert extend({2.0: 0.95, 2.8: 0.91}, GRID, 3) == 4.0  # held: up
    assert extend({2.0: 0.5, 2.8: 0.3}, GRID, 3) == 1.4  # missed: down
    assert extend({2.0: 0.95, 2.8: 0.91, 4.0: 0.92}, GRID, 3) is None  # max points
    assert extend({0.5: 0.3}, GRID, 3) is None  # the grid's bottom
    assert extend({2.0: 0.5, 2.8: 0.95}, GRID, 3) is None  # noise, nothing between
    assert extend({1.4: 0.5, 2.8: 0.95}, GRID, 3) == 2.0  # the rate between
    assert extend({2.0: None}, GRID, 3) is None  # a run that measured nothing
    assert extend({}, GRID, 3) is None


def test_sustainable_rates_and_their_ratio() -> None:
    ours = sustainable_rate([(2.0, 0.7), (1.0, 0.95)])
    assert ours["kind"] == "interpolated"
    assert ours["rps_per_model"] == pytest.approx(1.0 + 1.0 * 0.05 / 0.25)
    base = sustainable_rate([(0.5, 0.92), (1.0, 0.3)])
    assert base["rps_per_model"] == pytest.approx(0.5 + 0.5 * 0.02 / 0.62)
    assert rate_ratio(ours, base) == {"value": pytest.approx(1.2 / base["rps_per_model"]),
                                      "kind": "exact"}
    held = sustainable_rate([(1.0, 0.99), (2.0, 0.95)])
    assert held["kind"] == "at_least" and held["rps_per_model"] == 2.0
    below = sustainable_rate([(0.5, 0.6), (1.0, 0.4)])
    assert below["kind"] == "below" and below["upper_bound"] == 0.5
    assert below["rps_per_model"] is None and below["reason"]
    assert rate_ratio(held, base)["kind"] == "at_least"
    assert rate_ratio(ours, below) == {"value": pytest.approx(2.4), "kind": "at_least",
                                       "reason": rate_ratio(ours, below)["reason"]}
    assert rate_ratio(base, held)["kind"] == "at_most"
    assert rate_ratio(held, held)["value"] is None
    none = sustainable_rate([])
    assert none["rps_per_model"] is None and none["reason"]
    assert rate_ratio(none, base)["value"] is None


def test_the_workload_means_are_the_generators() -> None:
    assert SHAREGPT_INPUT.mean == gpu_check_paper.SHAREGPT_MEAN_PROMPT
    assert SHAREGPT_OUTPUT.mean == gpu_check_paper.SHAREGPT_MEAN_OUTPUT


def _run(tmp_path: Path) -> Path:
    trace = tmp_path / "run-trace.jsonl"
    records = [{"request_id": f"m{i}/0", "server_id": f"cmpl-{i}", "model": f"m{i}",
                "prompt_tokens": 100} for i in range(2)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    Path(f"{trace}.summary.json").write_text(json.dumps({"start_s": 100.0, "end_s": 110.0}))
    timing = {"arrival_s": 101.0, "num_tokens": 11, "decode_s": 0.5,
              "extra": {"prefill_compute_s": 0.2}}  # fmt: skip
    stats = {
        "timings": [{**timing, "request_id": "cmpl-0", "model": "m0"},
                    {**timing, "request_id": "cmpl-1", "model": "m1", "decode_s": 1.0},
                    {**timing, "request_id": "old", "model": "m0", "arrival_s": 50.0}],
        "switches": [{"to_model": "m1", "total_s": 0.2, "load_s": 0.2, "prefetched": False,
                      "at_s": 102.0},
                     {"to_model": "m0", "total_s": 0.01, "load_s": 0.1, "prefetched": True,
                      "at_s": 103.0},
                     {"to_model": "m0", "total_s": 9.0, "load_s": 9.0, "prefetched": False,
                      "at_s": 10.0}],  # before the run: not its
        "cache": {"model_cache": {"used_bytes": 300, "budget_bytes": 1000,
                                  "models": [{}, {}], "num_loads": 2}},
        "turns": [{"start_s": 104.0, "engine_s": 0.4, "steps": 10},
                  {"start_s": 20.0, "engine_s": 9.0, "steps": 10}],
        "instance_stats": {"p0": {"counters": {"prefill_tokens": 200.0, "prefill_s": 0.6}},
                           "d0": None},
    }  # fmt: skip
    Path(f"{trace}.stats.json").write_text(json.dumps(stats))
    samples = [{"used_bytes": 10, "capacity_bytes": 100, "devices": {"d0": {"kv_used_bytes": 5}}},
               {"used_bytes": 30, "capacity_bytes": 100,
                "devices": {"d0": {"kv_used_bytes": 50}, "p0": {"kv_used_bytes": 20}}}]
    Path(f"{trace}.kv.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return trace


def test_a_runs_files(tmp_path: Path) -> None:
    files = run_files(_run(tmp_path))
    costs = engine_costs(files)
    assert costs["m0"] == {"decode_s_per_step": 0.05, "prefill_s_per_token": 0.002,
                           "requests": 1}  # the timing before the window left out
    assert costs["m1"]["decode_s_per_step"] == 0.1
    # the node's: the turn in the window, the instances' prefill counters
    assert costs["*"] == {"decode_s_per_step": 0.04, "prefill_s_per_token": 0.003, "turns": 1}
    # two instances always busy: 2 / (2 models x mean(0.002 x 100 + step x 10))
    assert capacity_unit(costs, 100, 10, 2, 2) == pytest.approx(2 / (2 * 0.95))
    # a model without a decode measured takes the node's step
    partial = {"m0": {"decode_s_per_step": None, "prefill_s_per_token": 0.002}, "*": costs["*"]}
    assert capacity_unit(partial, 100, 10, 2, 2) == pytest.approx(2 / (2 * 0.6))
    assert capacity_unit({"*": costs["*"]}, 100, 10, 2, 2) == pytest.approx(2 / (2 * 0.7))
    assert capacity_unit({}, 100, 10, 2, 2) is None
    point = run_point({"slo_attainment": 0.9, "requests": 2, "switches": 2}, files,
                      {"m0": 4 * GB, "m1": 2 * GB}, 2, 100)
    assert point["slo_attainment"] == 0.9 and point["wall_s"] == 10.0
    switch = point["switch"]
    assert switch["records"] == 2 and switch["prefetched"] == 1
    assert switch["visible_s"] == pytest.approx(0.21) and switch["copy_gb_s"] == 10.0
    assert switch["visible_share"] == pytest.approx(0.21 / 20, abs=1e-5)
    memory = point["memory"]
    assert memory["host_kv_peak_bytes"] == 30 and memory["device_kv_peak_share"] == 0.5
    assert memory["device_kv_peak_bytes"] == {"d0": 50, "p0": 20}
    assert memory["model_cache"]["models"] == 2
    empty = run_point({"slo_attainment": 1.0, "requests": 0}, files, {}, 2, 100)
    assert empty["slo_attainment"] is None and empty["why"]


def test_every_point_holds_a_minute_and_thirty_requests() -> None:
    for plan in (gpu_check_paper.gpu_plan("cuda:0"), gpu_check_paper.CPU_PLAN):
        assert plan.load_s >= 60.0 and plan.grace_s >= 30.0 and plan.min_requests >= 30
        assert 2 <= plan.points <= plan.max_points <= 3
        slow = plan.load(8, 0.02)  # 0.16 RPS in all: 60 s expect 9.6 arrivals
        assert slow.load_s * 8 * 0.02 == pytest.approx(plan.min_requests)
        assert plan.load(8, 1.0).load_s == plan.load_s  # a busy rate keeps the minute
        assert plan.load(8, 0.02, probe=True).load_s == plan.probe_load_s
        assert plan.run_estimate_s(8, 1.0) >= plan.load_s + plan.grace_s
        assert plan.load_s < plan.run_estimate_s(8, 1.0, holds=True) < \
            plan.run_estimate_s(8, 1.0)  # a run predicted to hold drains soon
    assert gpu_check_paper.choose_plan(True, "cuda") is gpu_check_paper.DRY_PLAN
    assert gpu_check_paper.choose_plan(False, "cpu") is gpu_check_paper.CPU_PLAN
    assert gpu_check_paper.choose_plan(False, "cuda").device == "cuda:0"


def test_the_report_table_and_figure(tmp_path: Path) -> None:
    """``paper_report``: a row per measured point with its prediction beside it, a line per
    policy (sustainable rate, aegaeon's ratio, what a switch cost it), and the figure."""
    from aegaeon_bench.gpu_check.paper_report import figure, markdown, policy_lines, rows

    paper = {
        "policies": ["aegaeon", "request-level-charged"],
        "runs": {"aegaeon": [{"rps_per_model": 0.2, "requests": 40, "slo_attainment": 0.5},
                             {"rps_per_model": 0.1, "requests": 30, "slo_attainment": 1.0}],
                 "request-level-charged": [{"rps_per_model": 0.1, "requests": 30,
                                            "slo_attainment": 0.6}]},
        "predicted": {"policies": {"aegaeon": {"points": [
            {"rps_per_model": 0.1, "predicted": 0.98}, {"rps_per_model": 0.2,
                                                         "predicted": 0.55}]}}},
        "sustainable": {"aegaeon": {"rps_per_model": 0.18, "kind": "interpolated"},
                        "request-level-charged": {"rps_per_model": None, "kind": "below",
                                                  "upper_bound": 0.1}},
        "ratios": {"request-level-charged": {"value": 1.8, "kind": "at_least"}},
        "switches": {"request-level-charged": {"records": 4, "visible_ms_mean": 600.0,
                                               "charged_s": 2.0, "prefetched": 0,
                                               "resident": 0}},
        "models_per_gpu_at_paper_rps": {"aegaeon": 14.4},
        "rate_plan": {"left_out": {"static-mux": "no time"}},
        "machine": {"cpu": "AMD EPYC", "cpu_count": 2}, "models_per_gpu": 8,
    }  # fmt: skip
    assert [(r["policy"], r["rps_per_model"], r["predicted"]) for r in rows(paper)] == [
        ("aegaeon", 0.1, 0.98), ("aegaeon", 0.2, 0.55), ("request-level-charged", 0.1, None)]
    text = markdown(paper)
    assert "| aegaeon | 0.1 | 30 | 100.0% | 98.0% |" in text
    assert "| request-level-charged | < 0.1 (none) | >= 1.80x | 600.0 ms visible x 4 " \
           "(500 ms of it charged) | - |" in text
    lines = policy_lines(paper)
    assert lines[0].startswith("aegaeon: sustainable at 90% 0.18") and "14.4 models" in lines[0]
    assert lines[-1] == "static-mux: not run: no time"
    png = figure(paper, tmp_path / "paper.png")
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv,said", [
    (["--paper-policies", "aegaeon,nope"], "unknown nope"),
    (["--paper-policies", "aegaeon,aegaeon"], "named twice"),
    (["--paper-load-s", "0"], "--paper-load-s: must be > 0"),
    (["--budget-s", "-5"], "--budget-s: must be > 0"),
])  # fmt: skip
def test_gpu_check_refuses_bad_paper_arguments_before_anything_runs(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_bench.gpu_check.main import build_parser, main

    with pytest.raises(SystemExit) as info:
        main(["--scenario", "paper", "--dry-run", *argv])
    assert info.value.code == 2 and said in capsys.readouterr().err
    default = build_parser().parse_args(["--scenario", "paper"]).paper_policies
    assert default.split(",") == list(gpu_check_paper.POLICIES)
