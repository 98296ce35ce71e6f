"""The numbers of a `bench serve` run, from its trace records and the services' counters.

SLO attainment is the paper's (section 2.1) as :mod:`aegaeon_sched.slo`
computes it: token ``k`` (``k = 0`` first) meets its deadline when it reaches
the client by ``arrival + TTFT + k * TBT``; attainment is the share of all
tokens of all requests that do; a failed or unfinished request is charged
every token it should have produced. ``qos`` is the paper's artifact's
per-request time fraction, averaged over requests (failed ones score 0).
TTFT and TBT percentiles are over the tokens that arrived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aegaeon_sched.slo import SLO, summarize
from aegaeon_workload.stats_json import heartbeats
from aegaeon_workload.trace import TraceRecord

# The keys ``--json`` always prints, in this order (extras follow).
SUMMARY_KEYS = ("slo_attainment", "qos", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99",
                "switches", "completed", "failed", "requests")  # fmt: skip


def token_times(event_times_s: Sequence[float], num_tokens: int | None,
                finish_s: float | None = None) -> list[float]:  # fmt: skip
    """When each token reached the client, from the times of the SSE events with text.

    The stream says how many tokens there were (the final usage) but not how
    many each event carried: the detokenizer holds back tokens that end in an
    incomplete character and sends no text for special tokens. Every event
    with text delivers at least one token not shown before, so token ``k``
    arrived no later than text event ``k``, and tokens beyond the text events
    no later than the event that finished the stream (``finish_s``; else the
    last text event). Stamping them so gives an upper bound on every token's
    arrival (attainment is never flattered) that is exact when each event
    carried one token. Without a usage count (a stream cut short) each text
    event counts as one token.
    """
    times = list(event_times_s)
    if num_tokens is None:
        return times
    if num_tokens <= len(times):
        return times[:num_tokens]
    last = finish_s if finish_s is not None else (times[-1] if times else None)
    if last is None:
        return []
    return times + [last] * (num_tokens - len(times))


def instance_counter(stats: Mapping[str, Any] | None, name: str) -> float:
    """The sum of one counter over every instance of a ``/v1/aegaeon/stats`` answer."""
    if not stats:
        return 0.0
    total = 0.0
    for inst in heartbeats(stats).values():
        if inst:
            total += float((inst.get("counters") or {}).get(name, 0.0))
    return total


def counter_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None,
                  name: str) -> int | None:  # fmt: skip
    """How much an instance counter grew during the run (``None`` without stats)."""
    if after is None:
        return None
    return round(instance_counter(after, name) - instance_counter(before, name))


def summary(records: Sequence[TraceRecord], slo: SLO, *, switches: int | None = None,
            prefetched_switches: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The run's metrics: :data:`SUMMARY_KEYS` first, then token counts and extras."""
    report = summarize([r.to_slo() for r in records], slo)
    completed = sum(r.status == "ok" for r in records)
    return {
        "slo_attainment": report.attainment,
        "qos": report.qos,
        "ttft_p50": report.ttft_p50_s,
        "ttft_p99": report.ttft_p99_s,
        "tbt_p50": report.tbt_p50_s,
        "tbt_p99": report.tbt_p99_s,
        "switches": switches,
        "completed": completed,
        "failed": len(records) - completed,
        "requests": len(records),
        # of the failed: refused by admission (429 overloaded), as a node past its bound must
        "refused": sum(r.status != "ok" and (r.error or "").startswith("HTTP 429")
                       for r in records),
        "unfinished": report.num_unfinished,
        "tokens_expected": report.tokens_expected,
        "tokens_met": report.tokens_met,
        "tokens_received": sum(len(r.token_times_s) for r in records),
        "prefetched_switches": prefetched_switches,
        "ttft_p90": report.ttft_p90_s,
        "tbt_p90": report.tbt_p90_s,
        "ttft_s": slo.ttft_s,
        "tbt_s": slo.tbt_s,
    }


def per_model(records: Sequence[TraceRecord], slo: SLO) -> dict[str, dict[str, Any]]:
    """:func:`summary` of each model's requests (no switch counts)."""
    models = sorted({r.model for r in records})
    return {m: summary([r for r in records if r.model == m], slo) for m in models}


def by_class(records: Sequence[TraceRecord], class_of: Mapping[str, str | None],
             slo: SLO) -> dict[str, dict[str, Any]]:  # fmt: skip
    """:func:`summary` of each SLO class's requests against the class's default targets
    (:meth:`aegaeon_sched.SLOClasses.default` of ``slo``), no switch counts."""
    from aegaeon_sched import SLOClasses

    classes = SLOClasses.default(slo.ttft_s, slo.tbt_s)
    out = {}
    for c in classes.classes:
        mine = [r for r in records if class_of.get(r.request_id) == c.name]
        if mine:
            out[c.name] = summary(mine, SLO(c.ttft_s, c.tbt_s))
    return out
