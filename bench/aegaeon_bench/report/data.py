"""What `bench report` draws, read from a `bench serve` run's files and reduced to numbers.

Pure (no matplotlib): the trace records, the services' final stats, the KV
samples and the run's summary, and the reductions the figures need — the
latency breakdown of paper Fig. 14, the switch records of Fig. 15.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aegaeon_sched.slo import SLO
from aegaeon_workload.trace import RunFiles, TraceRecord, read_jsonl, read_trace

# Fig. 14's stages: label -> the timing fields (seconds) summed into it.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("prefill wait", ("prefill_wait_s",)),
    ("prefill", ("prefill_s",)),
    ("decode wait", ("decode_wait_s",)),
    ("decode", ("decode_s",)),
    ("KV overhead", ("kv_wait_s", "kv_control_s")),
)
ALL = "all"


@dataclass
class RunData:
    """One run's files, loaded; missing side files are empty."""

    records: list[TraceRecord]
    stats: dict[str, Any] | None = None
    kv: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def start_s(self) -> float:
        """The run's clock origin: its recorded start, else the first arrival."""
        if self.summary and self.summary.get("start_s"):
            return float(self.summary["start_s"])
        arrivals = [r.arrival_s for r in self.records]
        return min(arrivals) if arrivals else 0.0

    @property
    def end_s(self) -> float | None:
        return float(self.summary["end_s"]) if self.summary and self.summary.get("end_s") else None

    def slo(self, ttft_s: float | None = None, tbt_s: float | None = None) -> SLO:
        """The SLO of the run (its summary), with explicit overrides; else the paper's."""
        result = (self.summary or {}).get("result") or {}
        default = SLO()
        return SLO(ttft_s if ttft_s is not None else float(result.get("ttft_s", default.ttft_s)),
                   tbt_s if tbt_s is not None else float(result.get("tbt_s", default.tbt_s)))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def load_run(trace: Path) -> RunData:
    files = RunFiles(trace)
    stats = _read_json(files.stats)
    summary = _read_json(files.summary)
    kv = read_jsonl(files.kv) if files.kv.exists() else []
    return RunData(read_trace(trace), stats if isinstance(stats, dict) else None, kv,
                   summary if isinstance(summary, dict) else None)  # fmt: skip


def run_timings(data: RunData) -> list[dict[str, Any]]:
    """The services' per-request timings of this run's requests (all, if the trace has no ids)."""
    timings = list((data.stats or {}).get("timings") or [])
    ids = {r.server_id for r in data.records if r.server_id}
    return [t for t in timings if t.get("request_id") in ids] if ids else timings


def breakdown(timings: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Seconds per Fig. 14 stage, summed over requests: ``{"all": ..., model: ...}``."""
    totals: dict[str, dict[str, float]] = {ALL: dict.fromkeys((s for s, _ in STAGES), 0.0)}
    for timing in timings:
        model = str(timing.get("model"))
        per_model = totals.setdefault(model, dict.fromkeys((s for s, _ in STAGES), 0.0))
        for stage, keys in STAGES:
            seconds = sum(float(timing.get(k) or 0.0) for k in keys)
            totals[ALL][stage] += seconds
            per_model[stage] += seconds
    return totals


def shares(seconds: Mapping[str, float]) -> dict[str, float]:
    """Each stage's share of the total (zeros if there is no time at all)."""
    total = sum(seconds.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()}


def run_switches(data: RunData) -> list[dict[str, Any]]:
    """The services' switch records that happened during the run (all, if no window)."""
    switches = list((data.stats or {}).get("switches") or [])
    start, end = data.start_s, data.end_s
    if not data.summary or end is None:
        return switches
    return [s for s in switches if start <= float(s.get("at_s") or 0.0) <= end]


def gaps(records: Iterable[TraceRecord]) -> list[float]:
    """Every time between consecutive tokens of a request (TBT samples), seconds."""
    return [b - a for r in records for a, b in itertools.pairwise(r.token_times_s)]


def ttfts(records: Iterable[TraceRecord]) -> list[float]:
    return [r.token_times_s[0] - r.arrival_s for r in records if r.token_times_s]


def _kv_key(config: Mapping[str, Any]) -> str | None:
    """``L{layers} H{kv heads} D{head dim}`` of a config.json (the start of a shape label)."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return f"L{layers} H{kv_heads} D{head_dim}"


def shape_models(data: RunData) -> dict[str, list[str]]:
    """KV shape key (``L6 H4 D128``) -> the run's models of that shape, best effort.

    Read from the config.json files the run's summary names (``settings.limits``);
    empty when they are gone or the run did not know them.
    """
    limits = ((data.summary or {}).get("settings") or {}).get("limits") or {}
    found: dict[str, list[str]] = {}
    for model, limit in sorted(limits.items()):
        path = Path(str((limit or {}).get("source", "")))
        if path.name != "config.json" or not path.exists():
            continue
        try:
            key = _kv_key(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
        if key is not None:
            found.setdefault(key, []).append(model)
    return found


def sample_records(records: Sequence[TraceRecord], limit: int) -> list[TraceRecord]:
    """At most ``limit`` records spread evenly over the run, failed ones always kept."""
    if len(records) <= limit:
        return list(records)
    failed = [r for r in records if r.status != "ok"][:limit]
    room = limit - len(failed)
    ok = [r for r in records if r.status == "ok"]
    step = len(ok) / room if room > 0 else 0.0
    kept = [ok[int(i * step)] for i in range(room)] if room > 0 else []
    return sorted([*failed, *kept], key=lambda r: r.arrival_s)
