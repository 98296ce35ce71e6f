"""`bench serve` metrics through the trace path: hand-made traces written, read back, scored."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from aegaeon_bench.report.metrics import (
    SUMMARY_KEYS,
    counter_delta,
    per_model,
    summary,
    token_times,
)
from aegaeon_bench.serve.output import format_table, print_result
from aegaeon_sched import SLO
from aegaeon_workload.trace import TraceRecord, read_trace, write_trace

SLO_1S = SLO(ttft_s=1.0, tbt_s=0.5)  # deadlines of token k: arrival + 1 + 0.5 k


def _record(rid: str, times: list[float], expected: int, *, status: str = "ok",
            arrival: float = 0.0, model: str = "m") -> TraceRecord:  # fmt: skip
    return TraceRecord(rid, model, arrival, tuple(times), expected, status)  # type: ignore[arg-type]


def _through_file(tmp_path: Path, records: list[TraceRecord]) -> list[TraceRecord]:
    path = tmp_path / "trace.jsonl"
    write_trace(path, records)
    return read_trace(path)


def test_figure3_late_first_token_then_buffered_tokens_on_time(tmp_path: Path) -> None:
    # deadlines 1, 1.5, 2, 2.5, 3, 3.5: the first two tokens are late (a stall
    # before the first token), the next ones catch up on buffered time.
    times = [1.8, 1.9, 1.95, 2.0, 2.05, 2.1]
    [record] = _through_file(tmp_path, [_record("r", times, 6)])
    result = summary([record], SLO_1S)
    assert result["tokens_met"] == 4
    assert result["slo_attainment"] == pytest.approx(4 / 6)
    assert result["ttft_p50"] == pytest.approx(1.8)
    # the artifact's qos charges the whole stall before the first late token
    assert 0.0 < result["qos"] < 1.0


def test_figure3_long_stall_before_the_last_token_is_masked(tmp_path: Path) -> None:
    # a 2.5 s gap (5x TBT) before the last token, yet every token meets its
    # deadline: the earlier tokens ran ahead and buffered the stall
    times = [0.5, 0.6, 0.7, 0.8, 0.9, 3.4]
    [record] = _through_file(tmp_path, [_record("r", times, 6)])
    result = summary([record], SLO_1S)
    assert result["slo_attainment"] == 1.0
    assert result["tbt_p99"] == pytest.approx(2.5, rel=0.05)
    # one token more of stall and only the last token misses
    late = summary([_record("r", [*times[:-1], 3.6], 6)], SLO_1S)
    assert late["tokens_met"] == 5


def test_failed_and_unfinished_requests_charge_every_expected_token(tmp_path: Path) -> None:
    records = _through_file(tmp_path, [
        _record("ok", [0.5 + 0.1 * k for k in range(4)], 4),
        _record("failed-early", [0.5, 0.6], 10, status="failed"),  # 2 on time, 8 never came
        _record("http-error", [], 6, status="failed"),
    ])  # fmt: skip
    result = summary(records, SLO_1S)
    assert result["tokens_expected"] == 4 + 10 + 6
    assert result["tokens_met"] == 4 + 2
    assert result["slo_attainment"] == pytest.approx(6 / 20)
    assert (result["completed"], result["failed"], result["requests"]) == (1, 2, 3)
    assert result["qos"] == pytest.approx(1 / 3)  # failed requests score 0 (artifact's simulator)
    # an "ok" stream that ended short is unfinished: its missing tokens are missed too
    short = summary([_record("short", [0.5], 3)], SLO_1S)
    assert short["unfinished"] == 1 and short["slo_attainment"] == pytest.approx(1 / 3)


def test_artifact_qos_example() -> None:
    # from the artifact: arrival 0, tokens at 3, 6, 7, 8, TTFT 3, TBT 2 -> 5/8
    result = summary([_record("r", [3.0, 6.0, 7.0, 8.0], 4)], SLO(3.0, 2.0))
    assert result["qos"] == pytest.approx(5 / 8)


def test_summary_keys_and_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    records = [_record("a", [], 3, status="failed", model="x")]
    result = summary(records, SLO_1S, switches=7)
    assert tuple(result)[: len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert math.isnan(result["ttft_p50"])  # no token at all
    print_result(result, per_model(records, SLO_1S), as_json=True, out=sys.stdout)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    parsed = json.loads(last)  # strict: NaN became null
    assert parsed["ttft_p50"] is None and parsed["switches"] == 7
    assert "SLO attainment 0.0%" in format_table(result, {})


def test_token_times_bound_merged_events() -> None:
    assert token_times([1.0, 2.0, 3.0], 3) == [1.0, 2.0, 3.0]  # one token per event: exact
    # 5 tokens in 3 events: token k is stamped at event min(k, last), never before its arrival
    assert token_times([1.0, 2.0, 3.0], 5) == [1.0, 2.0, 3.0, 3.0, 3.0]
    # tokens beyond the text events (held back, special) came by the finishing event
    assert token_times([1.0, 2.0], 3, finish_s=2.5) == [1.0, 2.0, 2.5]
    assert token_times([], 1, finish_s=0.7) == [0.7]  # one token without text
    assert token_times([1.0, 2.0], None) == [1.0, 2.0]  # cut short: events count as tokens
    assert token_times([], 4) == []


def test_counter_delta_sums_instances() -> None:
    def stats(prefill: float, decode: float) -> dict[str, object]:
        return {"instances": {"prefill-0": {"counters": {"switches": prefill}},
                              "decode-0": {"counters": {"switches": decode}},
                              "gone-1": None}}  # fmt: skip

    assert counter_delta(stats(2, 3), stats(5, 10), "switches") == 10
    assert counter_delta(None, stats(1, 1), "switches") == 2
    assert counter_delta(stats(1, 1), None, "switches") is None
