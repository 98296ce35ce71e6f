"""`bench serve` files: trace round trip, side files, KV samples, the sweep schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aegaeon_bench.report.sweep_schema import Sweep, SweepError, SweepPoint, dump_sweep, load_sweep
from aegaeon_workload.trace import (
    RunFiles,
    TraceRecord,
    kv_sample,
    read_trace,
    write_jsonl,
    write_trace,
)

REQUIRED = {"request_id", "model", "arrival_s", "token_times_s", "expected_tokens", "status"}


def test_trace_round_trip(tmp_path: Path) -> None:
    records = [
        TraceRecord("m/0", "m", 1795300000.25, (1795300000.5, 1795300000.625), 2, "ok",
                    sent_s=1795300000.26, prompt_tokens=17, num_events=2, server_id="cmpl-1"),
        TraceRecord("m/1", "m", 1795300001.0, (), 5, "failed", error="HTTP 503: busy"),
    ]  # fmt: skip
    path = tmp_path / "t.jsonl"
    write_trace(path, records)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert all(set(json.loads(line)) >= REQUIRED for line in lines)
    assert json.loads(lines[1])["status"] == "failed"
    assert read_trace(path) == records


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = TraceRecord("a", "m", 0.0, (), 1, "ok").to_json()
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "status": "maybe"}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_trace(path)


def test_side_files_and_kv_samples(tmp_path: Path) -> None:
    files = RunFiles(tmp_path / "run.jsonl")
    assert files.stats.name == "run.jsonl.stats.json" and files.kv.name == "run.jsonl.kv.jsonl"
    assert files.summary.name == "run.jsonl.summary.json"
    stats = {
        "instances": {"decode-0": {"counters": {"kv_used_bytes": 10.0, "kv_fragmentation": 0.5}},
                      "prefill-0": {"counters": {"prefills": 1.0}}},
        "cache": {"kv": {"fragmentation": 0.25, "used_bytes": 3, "held_bytes": 4,
                         "peak_used_bytes": 5, "slab_bytes": 4, "shapes": [
            {"shape": {"num_layers": 6, "num_kv_heads": 4, "head_dim": 128, "block_size": 16,
                       "dtype": "bfloat16"},
             "block_bytes": 1, "used_blocks": 3, "held_slabs": 1, "fragmentation": 0.25}]}},
    }  # fmt: skip
    sample = kv_sample(stats, 12.5)
    assert sample["fragmentation"] == 0.25 and sample["t_s"] == 12.5
    assert sample["shapes"]["L6 H4 D128 bfloat16"]["used_blocks"] == 3
    assert list(sample["devices"]) == ["decode-0"]
    write_jsonl(files.kv, [sample, kv_sample({"cache": None}, 13.5)])
    second = json.loads(files.kv.read_text().splitlines()[1])
    assert second["fragmentation"] is None and second["shapes"] == {}


def test_sweep_schema_round_trip(tmp_path: Path) -> None:
    result = {"slo_attainment": 0.9, "qos": 0.95, "ttft_p50": float("nan"), "switches": 4,
              "completed": 10, "failed": 0, "requests": 10, "tokens_met": 900}  # fmt: skip
    points = [
        SweepPoint.from_result("aegaeon", 4, result, rps_per_model=0.2, trace="a.jsonl"),
        SweepPoint("request-level", 2, 0.5),
        SweepPoint("aegaeon", 2, 1.0, rps_per_model=0.2),
    ]
    path = tmp_path / "sweep.json"
    dump_sweep(path, points, {"ttft_s": 2.5})
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and raw["points"][0]["ttft_p50"] is None
    assert raw["points"][0]["tokens_met"] == 900  # unknown keys kept
    sweep = load_sweep(path)
    assert sweep.points[1] == points[1] and sweep.meta == {"ttft_s": 2.5}
    assert [p.models for p in sweep.series()["aegaeon"]] == [2, 4]
    with pytest.raises(SweepError):
        Sweep.from_json({"points": [{"policy": "x", "models": 2}]})
    with pytest.raises(SweepError):
        Sweep.from_json({"version": 99, "points": []})
