"""The client's view of a run: every token against its deadline, attainment, sweeps.

The timeline draws each request as a row (like paper Fig. 3): a line from
its arrival to its last token, each token a dot, green when it arrived by
``arrival + TTFT + k * TBT``, red when late; failed requests end in a cross.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aegaeon_sched.slo import SLO, percentile, token_hits
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from aegaeon_bench.report.data import RunData, gaps, sample_records, ttfts
from aegaeon_bench.report.metrics import per_model, summary
from aegaeon_bench.report.plots import PALETTE, no_data, save
from aegaeon_bench.report.sweep_schema import Sweep

MAX_ROWS = 150  # requests drawn in the timeline; more are sampled
MET, MISSED = "#2ca02c", "#d62728"
MIN_GAP_S = 1e-5  # log-axis floor: tokens that arrived together


def plot_timeline(data: RunData, slo: SLO, path: Path) -> Path:
    """Per-request token timeline, tokens colored by their deadlines."""
    records = sample_records(sorted(data.records, key=lambda r: r.arrival_s), MAX_ROWS)
    fig = Figure(figsize=(10, min(14.0, 2.0 + 0.09 * len(records))))
    ax = fig.add_subplot()
    if not records:
        no_data(ax, "requests")
        return save(fig, path)
    t0 = data.start_s
    models = sorted({r.model for r in records})
    colors = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(models)}
    end_s = data.end_s
    for row, record in enumerate(records):
        times = [t - t0 for t in record.token_times_s]
        arrival = record.arrival_s - t0
        last = times[-1] if times else arrival
        if record.status != "ok" and end_s is not None:
            last = max(last, end_s - t0)
        ax.plot([arrival, last], [row, row], color="#bbb", linewidth=0.6, zorder=1)
        ax.scatter([arrival], [row], marker="|", s=30, color=colors[record.model], zorder=3)
        hits = token_hits(record.to_slo(), slo)
        ax.scatter(times, [row] * len(times), s=3, linewidths=0, zorder=2,
                   c=[MET if hit else MISSED for hit in hits])  # fmt: skip
        if record.status != "ok":
            ax.scatter([last], [row], marker="x", s=25, color=MISSED, zorder=3)
    for model, color in colors.items():
        ax.scatter([], [], marker="|", s=40, color=color, label=f"arrival: {model}")
    ax.scatter([], [], s=12, color=MET, label="token on time")
    ax.scatter([], [], s=12, color=MISSED, label="token late")
    ax.scatter([], [], marker="x", s=25, color=MISSED, label="failed / unfinished")
    ax.invert_yaxis()
    ax.set_ylim(len(records), -1)
    ax.set_xlabel("time since the run's start (s)")
    shown = f"{len(records)} of {len(data.records)}" if len(records) < len(data.records) else ""
    ax.set_ylabel(f"request (by arrival) {shown}".strip())
    result = summary(data.records, slo)
    ax.set_title(
        f"Token timeline: SLO attainment {result['slo_attainment']:.1%} "
        f"(TTFT {slo.ttft_s:g} s, TBT {slo.tbt_s:g} s), {result['failed']} failed "
        f"of {result['requests']}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return save(fig, path)


def _cdf_panel(ax: Axes, values: Sequence[float], target: float, name: str, scale: float,
               unit: str) -> None:  # fmt: skip
    if not values:
        no_data(ax, name)
        return
    xs = sorted(v * scale for v in values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color="#3182bd")
    ax.axvline(target * scale, color=MISSED, linestyle="--", linewidth=1,
               label=f"target {target * scale:g} {unit}")  # fmt: skip
    p99 = percentile(list(values), 99) * scale
    ax.axvline(p99, color="#666", linestyle=":", linewidth=1, label=f"p99 {p99:.3g} {unit}")
    ax.set_xlabel(f"{name} ({unit})")
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def plot_attainment(data: RunData, slo: SLO, path: Path) -> Path:
    """Per-model token attainment and artifact qos; TTFT and TBT distributions."""
    fig = Figure(figsize=(13, 4))
    bars, ttft_ax, tbt_ax = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.3, 1, 1]})
    models = per_model(data.records, slo)
    if models:
        names = list(models)
        xs = range(len(names))
        attain = [100 * models[m]["slo_attainment"] for m in names]
        qos = [100 * models[m]["qos"] for m in names]
        bars.bar([x - 0.2 for x in xs], attain, width=0.4, color="#3182bd", label="SLO attainment")
        bars.bar([x + 0.2 for x in xs], qos, width=0.4, color="#9ecae1", label="artifact qos")
        for x, value, m in zip(xs, attain, names, strict=True):
            failed = models[m]["failed"]
            note = f"{value:.0f}%" + (f"\n{failed} failed" if failed else "")
            bars.text(x - 0.2, value + 1, note, ha="center", va="bottom", fontsize=7)
        bars.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
        bars.set_ylim(0, 115)
        bars.axhline(90, color="#888", linestyle="--", linewidth=1)
        bars.set_ylabel("%")
        bars.legend(fontsize=7, loc="lower left")
    else:
        no_data(bars, "requests")
    bars.set_title("per model", fontsize=9)
    _cdf_panel(ttft_ax, ttfts(data.records), slo.ttft_s, "TTFT", 1.0, "s")
    tbt_gaps = [max(g, MIN_GAP_S) for g in gaps(data.records)]
    _cdf_panel(tbt_ax, tbt_gaps, slo.tbt_s, "time between tokens, log", 1e3, "ms")
    if tbt_gaps:
        tbt_ax.set_xscale("log")
    fig.suptitle("SLO attainment summary (client-side token times)", fontsize=10)
    return save(fig, path)


def plot_sweep(sweep: Sweep, path: Path) -> Path:
    """Attainment against the number of models, one line per policy (cf. paper Fig. 11)."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    series = sweep.series()
    if not series:
        no_data(ax, "sweep points")
        return save(fig, path)
    for i, (label, points) in enumerate(series.items()):
        ax.plot([p.models for p in points], [100 * p.slo_attainment for p in points], marker="o",
                color=PALETTE[i % len(PALETTE)], label=label)  # fmt: skip
    ax.axhline(90, color="#888", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[0], 90.5, " 90% SLO", fontsize=7, color="#666", va="bottom")
    ax.set_xlabel("number of models")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    targets = ", ".join(
        f"{name} {value:g}{unit}"
        for key, name, unit in (
            ("rps_per_model", "RPS/model", ""), ("ttft_s", "TTFT", " s"), ("tbt_s", "TBT", " s"),
        )
        if isinstance(value := sweep.meta.get(key), int | float)
    )  # fmt: skip
    for key, name in (("input_scale", "prompts"), ("output_scale", "outputs")):
        scale = sweep.meta.get(key)
        if isinstance(scale, int | float) and scale != 1:
            targets += f", {name} x{scale:g}"
    title = "SLO attainment vs number of models" + (f" ({targets})" if targets else "")
    ax.set_title(title, fontsize=10)
    return save(fig, path)
