"""SLO attainment (paper section 2.1), the artifact's "qos", latency percentiles.

Token-deadline attainment (what we report): token ``k`` of a request
(``k = 0`` is the first token) meets its deadline when it is emitted by
``arrival + TTFT + k * TBT``. Attainment is the share of all tokens of all
requests that meet their deadlines. A failed or unfinished request is charged
every token it should have produced (``expected_tokens``): the tokens it did
emit on time count as met, the rest as missed. Buffering is built in: a late
first token misses, but later tokens emitted fast enough meet their own
deadlines again; a long stall before the last token costs only that token.

The artifact's "qos" (for comparison with the paper's plots): the paper's
artifact scores each request by the fraction of its lifetime that was "on
schedule" and averages over requests. Precisely, for token times
``tau_0..tau_{n-1}`` and cumulative targets ``T_k = TTFT + k * TBT`` (never
reset), walk the tokens keeping a segment start ``s`` (initially the
arrival) and a credit: token ``k`` is on schedule when ``tau_k - s <= T_k``
and then sets the credit to ``T_k``; a late token banks the credit, restarts
the segment at ``tau_k`` and zeroes the credit. At the end the open segment
adds ``min(T_n, tau_{n-1} - s)``; the request's qos is the banked total over
``tau_{n-1} - arrival`` (always in [0, 1]; 1 when that span is zero). The
artifact silently drops failed requests from its live runs; here a failed or
unfinished request (or one with no token) scores 0, as its simulator did.
Example (from the artifact): arrival 0, tokens at 3, 6, 7, 8, TTFT 3,
TBT 2 -> on schedule during (0, 3) and (6, 8): qos 5/8.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

# Tokens stamped at exactly their deadline must count as met despite float
# rounding in ``arrival + TTFT + k * TBT``.
_EPS_S = 1e-9


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 10.0
    tbt_s: float = 0.1

    def scaled(self, factor: float) -> SLO:
        return SLO(self.ttft_s * factor, self.tbt_s * factor)

    def deadline_s(self, arrival_s: float, k: int) -> float:
        """When token ``k`` (0: the first) of a request that arrived at ``arrival_s`` is due."""
        return arrival_s + self.ttft_s + k * self.tbt_s


@dataclass(frozen=True)
class RequestTrace:
    """What happened to one request: when each of its tokens was emitted."""

    request_id: str
    arrival_s: float
    expected_tokens: int
    token_times_s: Sequence[float]
    failed: bool = False

    @property
    def finished(self) -> bool:
        return not self.failed and len(self.token_times_s) >= self.expected_tokens


def _deadlines(trace: RequestTrace, slo: SLO) -> Iterator[float]:
    # Deadlines come from itertools.count (C speed); its repeated float
    # additions drift by ~1e-13 s over thousands of tokens, far below _EPS_S.
    return itertools.count(slo.deadline_s(trace.arrival_s, 0) + _EPS_S, slo.tbt_s)


def tokens_met(trace: RequestTrace, slo: SLO) -> int:
    """Number of the request's tokens emitted by their deadlines."""
    return sum(map(operator.le, trace.token_times_s, _deadlines(trace, slo)))


def token_hits(trace: RequestTrace, slo: SLO) -> list[bool]:
    """For each emitted token, whether it met its deadline (for plots of Fig. 3)."""
    return list(map(operator.le, trace.token_times_s, _deadlines(trace, slo)))


def attainment(traces: Iterable[RequestTrace], slo: SLO) -> float:
    """Share of all tokens (expected or emitted) that met their deadlines."""
    met = total = 0
    for trace in traces:
        met += tokens_met(trace, slo)
        total += max(trace.expected_tokens, len(trace.token_times_s))
    return met / total if total else 1.0


def artifact_qos(trace: RequestTrace, slo: SLO, met: int | None = None) -> float:
    """The artifact's per-request time fraction (see the module docstring).

    ``met`` (``tokens_met(trace, slo)``, if already known) allows a shortcut:
    when every token met its deadline no segment ever restarts and the
    request was on schedule all along.
    """
    times = trace.token_times_s
    if not trace.finished or not times:
        return 0.0
    span = times[-1] - trace.arrival_s
    if span <= 0:
        return 1.0
    if met is not None and met == len(times):
        return 1.0
    banked = credit = 0.0
    start = trace.arrival_s
    target = slo.ttft_s
    for t in times:
        if t - start <= target + _EPS_S:
            credit = target
        else:
            banked += credit
            start = t
            credit = 0.0
        target += slo.tbt_s
    banked += min(target, times[-1] - start)
    return min(1.0, banked / span)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of unsorted values (nan if empty)."""
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """:func:`percentile` at each of ``qs`` (the values sorted once)."""
    if not values:
        return [math.nan] * len(qs)
    ordered = sorted(values)
    out = []
    for q in qs:
        pos = (len(ordered) - 1) * q / 100.0
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


@dataclass(frozen=True)
class SLOReport:
    num_requests: int
    num_failed: int
    num_unfinished: int
    tokens_expected: int
    tokens_met: int
    attainment: float
    qos: float  # artifact's mean per-request time fraction
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p90_s: float
    tbt_p99_s: float


def summarize(
    traces: Sequence[RequestTrace], slo: SLO, *, tbt_percentiles: bool = True
) -> SLOReport:
    """Every metric at once. TBT percentiles sort every gap; skip them in big sweeps."""
    met = total = 0
    qos_sum = 0.0
    ttfts: list[float] = []
    gaps: list[float] = []
    failed = unfinished = 0
    for trace in traces:
        trace_met = tokens_met(trace, slo)
        met += trace_met
        total += max(trace.expected_tokens, len(trace.token_times_s))
        qos_sum += artifact_qos(trace, slo, trace_met)
        failed += trace.failed
        unfinished += not trace.failed and not trace.finished
        times = trace.token_times_s
        if times:
            ttfts.append(times[0] - trace.arrival_s)
            if tbt_percentiles:
                gaps.extend(b - a for a, b in itertools.pairwise(times))
    n = len(traces)
    ttft_p50, ttft_p90, ttft_p99 = percentiles(ttfts, (50, 90, 99))
    tbt_p50, tbt_p90, tbt_p99 = percentiles(gaps, (50, 90, 99))
    return SLOReport(
        num_requests=n,
        num_failed=failed,
        num_unfinished=unfinished,
        tokens_expected=total,
        tokens_met=met,
        attainment=met / total if total else 1.0,
        qos=qos_sum / n if n else 1.0,
        ttft_p50_s=ttft_p50,
        ttft_p90_s=ttft_p90,
        ttft_p99_s=ttft_p99,
        tbt_p50_s=tbt_p50,
        tbt_p90_s=tbt_p90,
        tbt_p99_s=tbt_p99,
    )
