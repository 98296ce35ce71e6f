"""`aegaeon bench serve` against a real `aegaeon serve` on a small market, then a clean stop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The e2e harness starts and stops `aegaeon serve` as a user would; reuse it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serve_harness import shm_segments, start_serve, stop_serve

NUM_MODELS = 3
BENCH_TIMEOUT_S = 90.0
EXPECTED_KEYS = {"slo_attainment", "qos", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99",
                 "switches", "completed", "failed", "requests"}  # fmt: skip


@pytest.fixture(scope="module")
def small_market(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh 3-model market of the ``small`` profile (~7 s to build)."""
    from aegaeon_market import ensure_market

    market = tmp_path_factory.mktemp("market")
    ensure_market(market, num_models=NUM_MODELS, profile="small", progress=False)
    return market


def test_bench_serve_live(small_market: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    served = start_serve(small_market, run_dir)
    try:
        trace = tmp_path / "trace.jsonl"
        argv = [sys.executable, "-m", "aegaeon_cli.main", "bench", "serve", "--url", served.url,
                "--models", "2", "--rps", "1.0", "--duration", "4", "--seed", "1",
                "--input-scale", "0.05", "--output-scale", "0.05", "--market", str(small_market),
                "--ttft", "5", "--tbt", "0.5", "--grace", "30", "--json", "--quiet",
                "--trace", str(trace)]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                              check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert set(result) >= EXPECTED_KEYS
        assert result["completed"] > 0 and result["failed"] == 0, (result, proc.stderr[-2000:])
        assert result["requests"] == result["completed"]
        assert 0.0 <= result["slo_attainment"] <= 1.0 and isinstance(result["switches"], int)
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        assert len(lines) == result["requests"]
        models = {line["model"] for line in lines}
        assert len(models) <= 2
        for line in lines:
            assert line["status"] == "ok"
            assert len(line["token_times_s"]) == line["expected_tokens"]
            assert line["arrival_s"] <= line["token_times_s"][0]
            assert line["token_times_s"] == sorted(line["token_times_s"])
        # Tokens travel a few steps per message (TBT 0.5 s: held up to 0.5 s) but
        # reach the client one event each (held back only by the detokenizer).
        events = sum(line["num_events"] for line in lines)
        assert events >= 0.8 * sum(line["expected_tokens"] for line in lines)
        stats = json.loads(trace.with_name(trace.name + ".stats.json").read_text())
        server_ids = {t["request_id"] for t in stats["timings"]}
        assert {line["server_id"] for line in lines} <= server_ids
        assert trace.with_name(trace.name + ".kv.jsonl").read_text().strip()
    finally:
        survivors = stop_serve(served)
    assert served.proc.returncode == 0, served.log_tail()
    assert not survivors, f"processes outlived aegaeon serve: {survivors}"
    assert not shm_segments(run_dir), f"shared memory left: {shm_segments(run_dir)}"
