"""`bench clients`: each client's report read into one row, and the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aegaeon_bench.serve.clients import (
    ClientResult,
    Load,
    _trace_latencies,
    aiperf_result,
    format_table,
    guidellm_result,
    run_aiperf,
)


def _stat(median: float, p99: float, mean: float, count: int) -> dict[str, object]:
    return {"successful": {"median": median, "mean": mean, "count": count,
                           "percentiles": {"p99": p99}}}  # fmt: skip


def test_guidellm_report_gives_one_row_per_strategy() -> None:
    bench = {
        "config": {"strategy": {"type_": "throughput", "max_concurrency": 512}},
        "metrics": {
            "request_totals": {"successful": 8, "errored": 700, "incomplete": 12, "total": 720},
            "requests_per_second": _stat(0.2, 0.5, 0.25, 8),
            "output_tokens_per_second": _stat(1.0, 9.0, 16.0, 500),
            "time_to_first_token_ms": _stat(900.0, 4000.0, 1200.0, 8),
            "inter_token_latency_ms": _stat(40.0, 60.0, 41.0, 8),
            "request_latency": _stat(3.5, 6.0, 3.8, 8),  # seconds
        },
    }
    idle = json.loads(json.dumps(bench))
    idle["config"]["strategy"] = {"type_": "synchronous"}
    for key in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency"):
        idle["metrics"][key]["successful"]["count"] = 0
    rows = guidellm_result({"benchmarks": [bench, idle]})
    assert [r.note.split(";")[0] for r in rows] == ["strategy throughput", "strategy synchronous"]
    first = rows[0]
    assert (first.completed, first.failed) == (8, 712)
    assert first.req_s == 0.25 and first.output_tok_s == 16.0
    assert (first.ttft_p50_ms, first.ttft_p99_ms, first.itl_p50_ms) == (900.0, 4000.0, 40.0)
    assert first.e2e_p50_ms == 3500.0
    assert rows[1].ttft_p50_ms is None and rows[1].e2e_p50_ms is None


def test_aiperf_report_counts_errors_or_what_did_not_come_back() -> None:
    def pct(p50: float, p99: float) -> dict[str, float]:
        return {"p50": p50, "p99": p99, "avg": p50}

    data: dict[str, object] = {
        "request_count": {"avg": 5.0}, "request_throughput": {"avg": 0.1},
        "output_token_throughput": {"avg": 6.4}, "time_to_first_token": pct(1800, 2000),
        "inter_token_latency": pct(30, 31), "request_latency": pct(3700, 3900),
    }  # fmt: skip
    row = aiperf_result(data, sent=6)
    assert (row.completed, row.failed, row.req_s) == (5, 1, 0.1)
    latencies = (row.ttft_p50_ms, row.ttft_p99_ms, row.itl_p50_ms, row.e2e_p50_ms)
    assert latencies == (1800, 2000, 30, 3700)
    data["error_request_count"] = {"avg": 3.0}
    assert aiperf_result(data, sent=6).failed == 3


def test_trace_latencies_count_per_request_not_per_chunk(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    # 5 tokens over 0.4 s, four of them in one chunk: 100 ms per token, not 0
    ok = {"status": "ok", "sent_s": 9.0, "token_times_s": [10.0, 10.4, 10.4, 10.4, 10.4]}
    failed = {"status": "error", "sent_s": 9.0, "token_times_s": [10.0]}
    trace.write_text("\n".join(json.dumps(r) for r in (ok, failed)) + "\n")
    itl, e2e = _trace_latencies(trace)
    assert itl == pytest.approx(100.0)
    assert e2e == pytest.approx(1400.0)


def test_a_client_not_installed_is_reported_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setenv("AEGAEON_CLIENTS_DIR", str(tmp_path))
    load = Load("http://127.0.0.1:1", "m", tmp_path, 0.1, 10.0, 16, 4, 0)
    row = run_aiperf(load, tmp_path)
    assert row.status == "missing" and "install-bench-clients" in row.note
    table = format_table([row, ClientResult("aegaeon", "ok", completed=3, failed=0, req_s=0.1)])
    lines = table.splitlines()
    assert lines[2].startswith("| aiperf | missing | - |")
    assert lines[3].startswith("| aegaeon | ok | 3 | 0 | 0.100 |")


def test_the_api_key_reaches_every_client_and_never_its_recorded_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each external client gets the key its own way (aiperf ``--api-key``, GuideLLM's
    backend ``api_key``, vLLM's bench ``$OPENAI_API_KEY``); the command printed and
    kept in the report shows ``***`` instead."""
    from aegaeon_bench.serve import clients

    key = "sk-bench-clients-5e1f"
    seen = tmp_path / "seen"
    seen.mkdir()
    script = "#!/bin/sh\nprintf '%s\\n' \"$@\" > {out}.argv\nenv > {out}.env\nexit 3\n"
    for venv, exe in (("aiperf-venv", "aiperf"), ("guidellm-venv", "guidellm")):
        path = tmp_path / venv / "bin" / exe
        path.parent.mkdir(parents=True)
        path.write_text(script.format(out=seen / exe))
        path.chmod(0o755)
    vllm_python = tmp_path / "vllm" / "bin" / "python"
    vllm_python.parent.mkdir(parents=True)
    vllm_python.write_text(script.format(out=seen / "vllm"))
    vllm_python.chmod(0o755)
    monkeypatch.setenv("AEGAEON_CLIENTS_DIR", str(tmp_path))
    monkeypatch.setattr(clients, "VLLM_VENV", tmp_path / "vllm")
    load = Load("http://127.0.0.1:1", "m", tmp_path, 0.1, 10.0, 16, 4, 0)
    out = tmp_path / "out"
    out.mkdir()
    rows = {name: clients.RUNNERS[name](load, out, key) for name in ("aiperf", "guidellm", "vllm")}
    for name, row in rows.items():
        assert row.status == "failed" and "exit 3" in row.note, (name, row)
        assert key not in row.command and key not in row.note, (name, row.command)
    assert "--api-key\n" + key in (seen / "aiperf.argv").read_text()
    assert f",api_key={key}" in (seen / "guidellm.argv").read_text()
    assert "***" in rows["aiperf"].command and "***" in rows["guidellm"].command
    assert f"OPENAI_API_KEY={key}" in (seen / "vllm.env").read_text().splitlines()
    assert key not in (seen / "vllm.argv").read_text()
