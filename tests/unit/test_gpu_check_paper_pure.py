"""The paper scenario's pure parts: the model mix, the device layout, the rate ladder, the
sustainable rate and its ratio, and what a run's files say."""

from __future__ import annotations

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
)
from aegaeon_bench.gpu_check.paper_stats import (
    capacity_unit,
    engine_costs,
    next_rate,
    rate_ratio,
    run_files,
    run_point,
    sustainable_rate,
)
from aegaeon_market.presets import PRESETS
from aegaeon_workload.synthetic import SHAREGPT_INPUT, SHAREGPT_OUTPUT

GB = 10**9
GiB = 1 << 30
SIZES = {name: p.params * 2 for name, p in PRESETS.items()}  # bf16 weights


def facts(ram: float = 128 * GiB, disk: float = 500 * GB, shm: float = 64 * GiB,
          gpu: float | None = 80 * GB, write: float = 2 * GB) -> MachineFacts:
    return MachineFacts(int(ram), int(disk), int(shm), None if gpu is None else int(gpu), write)


def fits_device(presets: tuple[str, ...], gpu_free: int) -> bool:
    layout = instance_layout([SIZES[p] for p in presets], gpu_free)
    per_instance = layout.device_memory_bytes + GPU_INSTANCE_MARGIN_BYTES
    return layout.kv_memory_bytes >= GPU_KV_MIN_BYTES and \
        2 * per_instance <= GPU_USABLE_FRACTION * gpu_free + 1


def test_a_roomy_machine_gets_the_preferred_mix() -> None:
    choice = choose_models(facts(gpu=140 * GB), SIZES, 60.0)
    assert choice.presets == PREFERRED
    assert choice.downgrades == choice.dropped == 0
    assert choice.total_bytes == sum(SIZES[p] for p in PREFERRED) <= choice.cap_bytes
    assert fits_device(choice.presets, 140 * GB)


@pytest.mark.parametrize("ram,disk,shm,write,binding", [
    (128 * GiB, 50 * GB, 64 * GiB, 2 * GB, "disk"),  # the lent machines: 64 GB of disk
    (40 * GiB, 500 * GB, 64 * GiB, 2 * GB, "host_ram"),
    (128 * GiB, 500 * GB, 16 * GiB, 2 * GB, "shm"),
    (128 * GiB, 500 * GB, 64 * GiB, 0.3 * GB, "build_time"),
])  # fmt: skip
def test_every_rule_bounds_the_weights(ram: float, disk: float, shm: float, write: float,
                                       binding: str) -> None:
    choice = choose_models(facts(ram, disk, shm, 80 * GB, write), SIZES, 60.0)
    assert choice.binding == binding
    assert 0 < choice.total_bytes <= choice.cap_bytes
    assert choice.cap_bytes == min(choice.caps.values())
    # shrunk, not dropped: still eight models, of more than one size
    assert len(choice.presets) == len(PREFERRED) and choice.dropped == 0
    assert choice.downgrades > 0 and len({SIZES[p] for p in choice.presets}) > 1
    assert fits_device(choice.presets, 80 * GB)


def test_the_device_caps_each_model() -> None:
    gpu = 24 * GB  # an A10: no 3B model fits twice in each of two instances
    cap = gpu_model_cap(gpu)
    assert cap is not None and cap < SIZES["llama-3.2-3b"]
    choice = choose_models(facts(gpu=gpu), SIZES, 60.0)
    assert choice.gpu_model_cap_bytes == cap
    assert all(SIZES[p] <= cap for p in choice.presets) and len(choice.presets) == 8
    assert fits_device(choice.presets, gpu)


def test_models_are_dropped_only_when_all_are_the_smallest() -> None:
    smallest = min(SIZES, key=lambda p: SIZES[p])
    choice = choose_models(facts(disk=3.5 * SIZES[smallest] / 0.6), SIZES, 60.0)
    assert choice.presets == (smallest,) * 3 and choice.dropped == 5
    nothing = choose_models(facts(disk=0), SIZES, 60.0)
    assert nothing.presets == () and nothing.total_bytes == 0


def test_a_cpu_has_no_device_cap_and_max_models_truncates() -> None:
    choice = choose_models(facts(gpu=None), SIZES, 60.0, max_models=4)
    assert choice.gpu_model_cap_bytes is None and choice.presets == PREFERRED[:4]


def test_layouts() -> None:
    cpu = instance_layout([100, 300], None)
    assert cpu.device_memory_bytes == 2 * 300 + (64 << 20) + cpu.kv_memory_bytes
    assert cpu.model_cache_bytes >= 400
    gpu = instance_layout([SIZES["llama-3.1-8b"], SIZES["qwen2.5-0.5b"]], 80 * GB)
    assert gpu.kv_memory_bytes >= GPU_KV_MIN_BYTES
    assert gpu.device_memory_bytes - gpu.kv_memory_bytes == 2 * SIZES["llama-3.1-8b"] + (64 << 20)


def test_the_ladder_brackets_the_crossing() -> None:
    ladder = [0.25, 0.5, 1.0, 2.0, 4.0]
    assert next_rate({}, ladder, 1.0) == 1.0
    assert next_rate({1.0: 0.95}, ladder, 1.0) == 2.0
    assert next_rate({1.0: 0.95, 2.0: 0.97}, ladder, 1.0) == 4.0
    assert next_rate({1.0: 0.95, 2.0: 0.97, 4.0: 0.99}, ladder, 1.0) is None  # the top
    assert next_rate({1.0: 0.95, 2.0: 0.5}, ladder, 1.0) is None  # bracketed
    assert next_rate({1.0: 0.5}, ladder, 1.0) == 0.5
    assert next_rate({1.0: 0.5, 0.5: 0.8, 0.25: 0.85}, ladder, 1.0) is None  # the bottom
    assert next_rate({1.0: None}, ladder, 1.0) is None  # a run that measured nothing


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


def test_a_low_rate_runs_until_enough_arrivals_are_expected() -> None:
    plan = gpu_check_paper.gpu_plan("cuda:0", load_s=15.0)
    # the H100's baseline run: 8 models at 0.0179 RPS each expect 2.1 arrivals in 15 s
    slow = plan.load(8, 0.0179)
    assert slow.load_s * 8 * 0.0179 == pytest.approx(plan.min_requests)
    assert plan.load(8, 1.0).load_s == plan.load_s  # a busy rate keeps the plan's length
    assert plan.load(8, 0.0179, probe=True).load_s == plan.probe_load_s
