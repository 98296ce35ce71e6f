"""PNG figures shaped like the paper's (matplotlib, Agg backend; imported lazily)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from aegaeon_sim.figures import POLICY_LABELS, THRESHOLD, Panel, Point, max_at

COLORS = {
    "aegaeon": "#d62728",
    "request-level": "#1f77b4",
    "request-level-sjf": "#2ca02c",
    "request-level-global": "#9467bd",
    "request-level-global-sjf": "#8c564b",
    "static-mux": "#7f7f7f",
}


def plot_figure(
    name: str,
    panels: Sequence[Panel],
    results: Mapping[str, Mapping[str, Sequence[Point]]],
    out: Path,
    *,
    note: str = "",
) -> Path:
    """One subplot per panel: SLO attainment (solid) and the artifact's qos
    (dotted) against the swept x, the 90% line, and a vertical line at each
    policy's largest x meeting 90% attainment."""
    from aegaeon_bench.report.plotting import pyplot

    plt = pyplot()
    width = max(6.5, 5.2 * len(panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for policy, points in results[panel.key].items():
            if not points:
                continue
            color = COLORS.get(policy)
            xs = [p.x for p in points]
            ax.plot(xs, [100 * p.attainment for p in points], "-o", ms=3.5, color=color,
                    label=POLICY_LABELS.get(policy, policy))  # fmt: skip
            ax.plot(xs, [100 * p.qos for p in points], ":", color=color, lw=1.0)
            best = max_at(points)
            if best is not None:
                ax.axvline(best, color=color, ls="--", lw=0.8, alpha=0.7)
        ax.axhline(100 * THRESHOLD, color="black", lw=0.6)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("number of models" if panel.x_axis == "models" else "RPS per model")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(
        f"Fig. {name} (simulated; solid: token-deadline attainment, dotted: artifact qos)"
        + (f"\n{textwrap.fill(note, int(14 * width))}" if note else ""),
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
