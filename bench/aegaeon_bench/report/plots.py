"""The services' view of a run, drawn like the paper's Fig. 14-16.

Each function writes one PNG and returns its path. Figures are built with
``matplotlib.figure.Figure`` (no pyplot, no global state, Agg canvas).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from aegaeon_bench.report.data import (
    ALL,
    STAGES,
    RunData,
    breakdown,
    run_switches,
    run_timings,
    shape_models,
)
from aegaeon_bench.report.data import shares as stage_shares

DPI = 130
MiB = float(1 << 20)
STAGE_COLORS = ("#f2b134", "#ed553b", "#9ecae1", "#3182bd", "#756bb1")
PALETTE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666")
MIN_SWITCH_MS = 0.01  # log axis floor for switches that cost (almost) nothing


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center",
            transform=ax.transAxes, color="#888")  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])


def plot_breakdown(data: RunData, path: Path) -> Path:
    """Fig. 14: the share of all requests' time in each stage, overall and per model."""
    timings = run_timings(data)
    totals = breakdown(timings)
    counts = {ALL: len(timings)}
    for t in timings:
        counts[str(t.get("model"))] = counts.get(str(t.get("model")), 0) + 1
    rows = [ALL, *sorted(k for k in totals if k != ALL)]
    fig = Figure(figsize=(8.5, 1.2 + 0.45 * len(rows)))
    ax = fig.add_subplot()
    if not timings:
        no_data(ax, "server timings")
        return save(fig, path)
    for y, row in enumerate(rows):
        left = 0.0
        for (stage, _), color in zip(STAGES, STAGE_COLORS, strict=True):
            share = stage_shares(totals[row])[stage]
            ax.barh(y, share * 100, left=left, color=color, edgecolor="white", height=0.7,
                    label=stage if y == 0 else None)  # fmt: skip
            if share >= 0.06:
                ax.text(left + share * 50, y, f"{share:.0%}", ha="center", va="center",
                        fontsize=8, color="black")  # fmt: skip
            left += share * 100
        seconds = sum(totals[row].values())
        ax.text(101, y, f"{counts.get(row, 0)} req, {seconds:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{r} (all models)" if r == ALL else r for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of total request time (%)")
    ax.set_title("Request latency breakdown (cf. paper Fig. 14; services' per-request timings)",
                 fontsize=10)  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, ncols=len(STAGES), loc="lower center", fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.02))  # fmt: skip
    empty = [stage for stage, _ in STAGES if totals[ALL][stage] == 0.0]
    if empty:
        fig.text(0.5, -0.08, f"no time reported for: {', '.join(empty)}", ha="center",
                 fontsize=7, color="#666")  # fmt: skip
    fig.subplots_adjust(bottom=0.3 if len(rows) < 4 else 0.2)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return save(fig, path)


def _cdf(ax: Axes, values_s: Sequence[float], label: str, **style: Any) -> None:
    xs = sorted(max(v * 1e3, MIN_SWITCH_MS) for v in values_s)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, **style)


def plot_switch_cdf(data: RunData, path: Path) -> Path:
    """Fig. 15 (left): CDF of model-switch latency on the critical path, prefetched or not."""
    switches = run_switches(data)
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    if not switches:
        no_data(ax, "model switches")
        return save(fig, path)
    kinds = sorted({str(s.get("instance", "")).split("-")[0] for s in switches})
    styles = {"prefill": "--", "decode": "-"}
    for prefetched, color in ((False, "#d62728"), (True, "#2ca02c")):
        for kind in kinds:
            group = [float(s["total_s"]) for s in switches
                     if bool(s.get("prefetched")) == prefetched
                     and str(s.get("instance", "")).startswith(kind)]  # fmt: skip
            if not group:
                continue
            median_ms = sorted(group)[len(group) // 2] * 1e3
            label = (f"{kind}, {'prefetched' if prefetched else 'not prefetched'} "
                     f"(n={len(group)}, p50 {median_ms:.1f} ms)")  # fmt: skip
            _cdf(ax, group, label, color=color, linestyle=styles.get(kind, ":"), linewidth=1.8)
    _cdf(ax, [float(s["total_s"]) for s in switches], f"all (n={len(switches)})",
         color="black", linewidth=1, alpha=0.5)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("switch latency on the critical path (ms, log)")
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.set_title("Model switch latency (cf. paper Fig. 15 left)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return save(fig, path)


def _shape_series(kv: Sequence[Mapping[str, Any]]) -> list[str]:
    labels: dict[str, None] = {}
    for sample in kv:
        for label, shape in (sample.get("shapes") or {}).items():
            if shape and (shape.get("held_slabs") or shape.get("used_blocks")):
                labels[label] = None
    return list(labels)


def _shape(sample: Mapping[str, Any], label: str) -> Mapping[str, Any]:
    return (sample.get("shapes") or {}).get(label) or {}


def _frag_pct(value: Any, held: bool) -> float:
    """Fragmentation in %, NaN where nothing is held (unused / peak is undefined there)."""
    return 100.0 * float(value or 0.0) if held else math.nan


def _legend_label(label: str, models: Mapping[str, list[str]]) -> str:
    key = " ".join(label.split()[:3])
    return f"{label} ({', '.join(models[key])})" if key in models else label


def plot_kv(data: RunData, path: Path) -> Path:
    """Fig. 16: unified CPU KV cache fragmentation over time, overall and per shape; usage."""
    kv = [s for s in data.kv if s.get("fragmentation") is not None]
    fig = Figure(figsize=(8, 6))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    if not kv:
        no_data(top, "KV cache samples")
        no_data(bottom, "KV cache samples")
        return save(fig, path)
    t0 = data.start_s
    xs = [float(s["t_s"]) - t0 for s in kv]
    labels = _shape_series(kv)
    colors = {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(labels)}
    models = shape_models(data)
    for label in labels:
        frag = [_frag_pct(_shape(s, label).get("fragmentation"),
                          bool(_shape(s, label).get("held_slabs"))) for s in kv]  # fmt: skip
        top.plot(xs, frag, color=colors[label], linewidth=1, alpha=0.85, marker=".",
                 markersize=3, label=_legend_label(label, models))  # fmt: skip
    overall = [_frag_pct(s["fragmentation"], bool(s.get("held_bytes"))) for s in kv]
    top.plot(xs, overall, color="black", linewidth=2.2, marker="o", markersize=3,
             label="overall")  # fmt: skip
    top.axhline(20, color="#888", linestyle="--", linewidth=1)
    top.text(xs[0], 20.5, "20% (paper)", fontsize=7, color="#666", va="bottom")
    top.set_ylabel("fragmentation (%)\nunused / peak allocated")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
               title="KV shape (models)", title_fontsize=7)  # fmt: skip
    top.set_title("Unified CPU KV cache (cf. paper Fig. 16); gaps: nothing held", fontsize=10)
    used = [
        [float(_shape(s, label).get("used_blocks") or 0)
         * float(_shape(s, label).get("block_bytes") or 0) / MiB for s in kv]
        for label in labels
    ]  # fmt: skip
    if labels:
        bottom.stackplot(xs, used, colors=[colors[label] for label in labels], alpha=0.8)
    bottom.plot(xs, [float(s.get("held_bytes") or 0) / MiB for s in kv], color="black",
                linewidth=1.2, label="held by slabs")  # fmt: skip
    bottom.set_ylabel("MiB (used by shape)")
    bottom.set_xlabel("time since the run's start (s)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save(fig, path)
