"""`bench report` draws its PNGs from a hand-made trace, stats, KV samples and a sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
from aegaeon_bench.report.data import breakdown, load_run, run_switches, run_timings, shares
from aegaeon_bench.report.sweep_schema import SweepPoint, dump_sweep
from aegaeon_workload.trace import RunFiles, TraceRecord, write_json, write_jsonl, write_trace

T0 = 1795300000.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _shape(layers: int, used: int, held: int, frag: float) -> dict[str, object]:
    shape = {"num_layers": layers, "num_kv_heads": 2, "head_dim": 64, "block_size": 16,
             "dtype": "bfloat16"}  # fmt: skip
    return {"shape": shape, "block_bytes": 65536, "used_blocks": used, "held_slabs": held,
            "fragmentation": frag}  # fmt: skip


def _run(tmp_path: Path) -> RunFiles:
    files = RunFiles(tmp_path / "run.jsonl")
    records = [
        TraceRecord(f"a/{i}", "a", T0 + i, tuple(T0 + i + 0.2 + 0.05 * k for k in range(20)), 20,
                    "ok", server_id=f"cmpl-a{i}")
        for i in range(6)
    ] + [
        TraceRecord("b/0", "b", T0 + 1, (T0 + 4.0, T0 + 4.1), 10, "failed", server_id="cmpl-b0",
                    error="unfinished at the end of the run plus the grace period"),
    ]  # fmt: skip
    write_trace(files.trace, records)
    timing = {"prefill_wait_s": 0.1, "prefill_s": 0.2, "decode_wait_s": 0.5, "decode_s": 1.0,
              "kv_wait_s": 0.05, "kv_control_s": 0.01}  # fmt: skip
    stats = {
        "instances": {"decode-0": {"counters": {"switches": 5.0}}},
        "switches": [
            {"instance": "decode-0", "from_model": "a", "to_model": "b", "total_s": 0.002 * i,
             "load_s": 0.01, "prefetched": i % 2 == 0, "at_s": T0 + i}
            for i in range(8)
        ] + [{"instance": "prefill-0", "from_model": "b", "to_model": "a", "total_s": 0.03,
              "load_s": 0.03, "prefetched": False, "at_s": T0 + 2}],
        "timings": [{"request_id": f"cmpl-a{i}", "model": "a", **timing} for i in range(6)]
        + [{"request_id": "cmpl-other", "model": "zzz", **timing}],  # not this run's
    }  # fmt: skip
    write_json(files.stats, stats)
    write_jsonl(files.kv, [
        {"t_s": T0 + i, "fragmentation": 0.1 * (i % 3), "held_bytes": (i % 4) * 4194304,
         "shapes": {"L4 H2 D64 bfloat16": _shape(4, i, i % 2, 0.2),
                    "L6 H2 D64 bfloat16": _shape(6, 2 * i, 1, 0.05)}}
        for i in range(10)
    ])  # fmt: skip
    summary = {"start_s": T0 - 0.5, "end_s": T0 + 12, "settings": {"limits": {}},
               "result": {"ttft_s": 1.0, "tbt_s": 0.1}}  # fmt: skip
    write_json(files.summary, summary)
    return files


def test_report_data_reductions(tmp_path: Path) -> None:
    data = load_run(_run(tmp_path).trace)
    timings = run_timings(data)
    assert {t["request_id"] for t in timings} == {f"cmpl-a{i}" for i in range(6)}
    totals = breakdown(timings)
    assert set(totals) == {"all", "a"}
    assert totals["all"]["KV overhead"] == pytest.approx(6 * 0.06)
    assert sum(shares(totals["all"]).values()) == pytest.approx(1.0)
    assert len(run_switches(data)) == 9
    assert data.slo().ttft_s == 1.0 and data.slo(ttft_s=3.0).ttft_s == 3.0


def test_report_writes_every_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_cli.main import main

    files = _run(tmp_path)
    sweep = tmp_path / "sweep.json"
    dump_sweep(sweep, [SweepPoint(policy, n, 1.0 - n * d, rps_per_model=0.1)
                       for policy, d in (("aegaeon", 0.02), ("request-level", 0.1))
                       for n in (2, 4, 6)], {})  # fmt: skip
    out = tmp_path / "report"
    argv = ["bench", "report", str(files.trace), "--out", str(out), "--sweep", str(sweep)]
    assert main(argv) == 0
    printed = capsys.readouterr().out.split()
    names = {"breakdown.png", "switch_cdf.png", "kv_fragmentation.png", "timeline.png",
             "attainment.png", "sweep.png"}  # fmt: skip
    assert {Path(p).name for p in printed} == names
    for path in map(Path, printed):
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_report_of_an_empty_run_still_draws(tmp_path: Path) -> None:
    from aegaeon_bench.report.figures import write_report

    trace = tmp_path / "empty.jsonl"
    trace.write_text("")
    paths = write_report(trace, tmp_path / "out")
    assert len(paths) == 5 and all(p.exists() for p in paths)
