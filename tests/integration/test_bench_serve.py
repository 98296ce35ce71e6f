"""`aegaeon bench serve` against a real `aegaeon serve` on a small market (the shared node
of tests/conftest.py, which checks its clean stop), on 3 of its models.

The load is derived from what this machine measures, never a fixed rate: a
probe first serves a few of the workload's own requests one at a time, and the
run then offers a quarter of the requests per second that one-at-a-time pace
would sustain. The test asserts outcomes (every request accounted for and
completed, the switches that 3 models on 2-model buffers force, no KV block,
process or shared-memory segment left), never how fast they were.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from http_support import call_json
from serve_harness import Served

NUM_MODELS = 3
LOAD_FRACTION = 0.25  # of the one-at-a-time capacity the probe measures
DURATION_S = 6.0
SEED = 1
SCALE = 0.05  # ShareGPT input and output lengths x this
EXPECTED_KEYS = {"slo_attainment", "qos", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99",
                 "switches", "completed", "failed", "requests"}  # fmt: skip


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    status, reply = call_json(url, "POST", "", body)
    assert status == 200 and isinstance(reply, dict), (status, reply)
    return reply


def probe_rps_per_model(served: Served, market: Path, models: list[str]) -> float:
    """Requests/s per model at ``LOAD_FRACTION`` of the pace of one request at a time.

    Serves the first requests of the workload (same seed and scale as the run,
    so the same lengths) sequentially after one warm-up per model, and takes
    the mean time a request occupies the node alone.
    """
    from aegaeon_workload.plan import model_limits, plan_requests

    plan = plan_requests(models, model_limits(models, market), rps_per_model=1.0,
                         duration_s=30.0, seed=SEED, input_scale=SCALE,
                         output_scale=SCALE)  # fmt: skip
    url = served.url + "/v1/completions"

    def serve(p: object) -> float:
        start = time.perf_counter()
        reply = _post(url, {"model": p.model, "prompt": p.prompt_ids(),  # type: ignore[attr-defined]
                            "max_tokens": p.max_tokens, "ignore_eos": True,  # type: ignore[attr-defined]
                            "temperature": 0})  # fmt: skip
        assert reply["usage"]["completion_tokens"] == p.max_tokens  # type: ignore[index,attr-defined]
        return time.perf_counter() - start

    for model in models:  # warm-up: first switches, first shapes
        serve(next(p for p in plan if p.model == model))
    seconds = [serve(p) for p in plan[:9]]
    capacity_rps = len(seconds) / sum(seconds)
    return LOAD_FRACTION * capacity_rps / len(models)


def _stats(served: Served) -> dict[str, object]:
    return served.get_json("/v1/aegaeon/stats")


def test_bench_serve_live(served: Served, small_market: Path, tmp_path: Path) -> None:
    models = [m["id"] for m in served.get_json("/v1/models")["data"]][:NUM_MODELS]  # type: ignore[index]
    rps = probe_rps_per_model(served, small_market, models)
    switches_before = _switches(_stats(served))
    trace = tmp_path / "trace.jsonl"
    argv = [sys.executable, "-m", "aegaeon_cli.main", "bench", "serve", "--url", served.url,
            "--models", str(NUM_MODELS), "--rps", f"{rps:.4f}", "--duration",
            str(DURATION_S), "--seed", str(SEED), "--input-scale", str(SCALE),
            "--output-scale", str(SCALE), "--market", str(small_market),
            "--ttft", "5", "--tbt", "0.5", "--grace", "120", "--json", "--quiet",
            "--trace", str(trace)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"probed {rps:.3f} RPS per model: {result['requests']} requests, "
          f"attainment {result['slo_attainment']:.3f}, {result['switches']} switches")
    assert set(result) >= EXPECTED_KEYS
    # every request accounted for, and at a quarter of capacity every one completes
    assert result["requests"] > 0
    assert result["completed"] == result["requests"], (rps, result, proc.stderr[-2000:])
    assert result["failed"] == 0 and result["unfinished"] == 0
    assert 0.0 <= result["slo_attainment"] <= 1.0 and isinstance(result["switches"], int)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == result["requests"]
    assert {line["model"] for line in lines} <= set(models)
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
    # 3 models on instances whose buffers hold 2: serving them all means switching
    if len({line["model"] for line in lines}) == NUM_MODELS:
        assert _switches(_stats(served)) > switches_before
    _assert_no_kv_held(served)


def _switches(stats: dict[str, object]) -> float:
    instances = stats["instance_stats"]
    assert isinstance(instances, dict)
    return sum(float(s["counters"].get("switches", 0.0)) for s in instances.values() if s)


def _assert_no_kv_held(served: Served, timeout_s: float = 30.0) -> None:
    """Every request has finished: no KV bytes on any instance or in the host cache."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _stats(served)
        cache = stats["cache"]
        instances = stats["instance_stats"]
        assert isinstance(cache, dict) and isinstance(instances, dict)
        host = float(cache["kv"]["used_bytes"]) + float(cache["kv"]["move_list_blocks"])
        device = sum(float(s["counters"].get("kv_used_bytes", 0.0))
                     for s in instances.values() if s)  # fmt: skip
        if (host, device) == (0.0, 0.0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held after every request ended: host {host} "
                                 f"device {device}")  # fmt: skip
        time.sleep(0.5)  # heartbeats report every 0.5 s
