"""Token-deadline SLO attainment, the artifact's qos, percentiles."""

from __future__ import annotations

import math

import pytest
from aegaeon_sched import SLO, RequestTrace, artifact_qos, attainment, summarize, tokens_met

SLO_PAPER = SLO(10.0, 0.1)


def _on_time(rid: str = "r", n: int = 10, arrival: float = 0.0) -> RequestTrace:
    return RequestTrace(rid, arrival, n, [arrival + 1.0 + 0.05 * k for k in range(n)])


def test_all_on_time() -> None:
    trace = _on_time()
    assert tokens_met(trace, SLO_PAPER) == 10
    assert attainment([trace], SLO_PAPER) == 1.0
    assert artifact_qos(trace, SLO_PAPER) == 1.0


def test_deadline_is_inclusive() -> None:
    times = [10.0 + 0.1 * k for k in range(50)]  # exactly at every deadline
    assert tokens_met(RequestTrace("r", 0.0, 50, times), SLO_PAPER) == 50


def test_figure3_late_first_token_then_buffered_tokens_on_time() -> None:
    # First token at 12 s (TTFT 10 s missed); then 10 ms apart: token k is due
    # at 10 + 0.1 k, emitted at 12 + 0.01 k -> on time again from k = 23.
    times = [12.0 + 0.01 * k for k in range(100)]
    trace = RequestTrace("r", 0.0, 100, times)
    assert tokens_met(trace, SLO_PAPER) == 100 - 23
    assert attainment([trace], SLO_PAPER) == pytest.approx(0.77)
    # The artifact charges the whole 12 s stall: on schedule only after it.
    assert 0.0 < artifact_qos(trace, SLO_PAPER) < 0.2


def test_figure3_long_stall_before_the_last_token_is_masked_by_buffering() -> None:
    # 99 tokens streamed fast from 1 s, then a 8 s stall before the last one:
    # the last token is due at 10 + 9.9 = 19.9 s, emitted at 1 + 0.98 + 8 = 9.98 s.
    times = [1.0 + 0.01 * k for k in range(99)]
    times.append(times[-1] + 8.0)
    trace = RequestTrace("r", 0.0, 100, times)
    assert attainment([trace], SLO_PAPER) == 1.0
    # ... but a stall past the buffered slack costs exactly the late tokens.
    times[-1] = 25.0
    assert tokens_met(RequestTrace("r", 0.0, 100, times), SLO_PAPER) == 99


def test_failed_and_unfinished_requests_count_missing_tokens_as_missed() -> None:
    ok = _on_time("a", 10)
    unfinished = RequestTrace("b", 0.0, 10, [1.0, 1.1, 1.2])  # 3 of 10 emitted, on time
    failed = RequestTrace("c", 0.0, 10, [], failed=True)
    assert attainment([ok, unfinished, failed], SLO_PAPER) == pytest.approx(13 / 30)
    report = summarize([ok, unfinished, failed], SLO_PAPER)
    assert report.num_failed == 1 and report.num_unfinished == 1
    assert report.tokens_expected == 30 and report.tokens_met == 13
    # The artifact's qos scores both as 0 (its simulator did; its live runs dropped them).
    assert report.qos == pytest.approx(1 / 3)


def test_artifact_qos_reproduces_the_artifact_example() -> None:
    # Arrival 0, tokens at 3, 6, 7, 8, TTFT 3, TBT 2: on schedule (0,3) and (6,8).
    trace = RequestTrace("r", 0.0, 4, [3.0, 6.0, 7.0, 8.0])
    assert artifact_qos(trace, SLO(3.0, 2.0)) == pytest.approx(5 / 8)


def test_percentiles() -> None:
    traces = [RequestTrace(f"r{i}", 0.0, 2, [float(i), float(i) + 0.1]) for i in range(1, 101)]
    report = summarize(traces, SLO_PAPER)
    assert report.ttft_p50_s == pytest.approx(50.5)
    assert report.ttft_p99_s == pytest.approx(99.01)
    assert report.tbt_p90_s == pytest.approx(0.1)
    empty = summarize([], SLO_PAPER)
    assert empty.attainment == 1.0 and math.isnan(empty.ttft_p50_s)


def test_stricter_slo_scales_both_targets() -> None:
    strict = SLO_PAPER.scaled(0.2)
    assert (strict.ttft_s, strict.tbt_s) == pytest.approx((2.0, 0.02))
