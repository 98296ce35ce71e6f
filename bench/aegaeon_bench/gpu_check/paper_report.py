"""The paper scenario's results as a table, a markdown table and a figure.

``python -m aegaeon_bench.gpu_check.paper_report gpu-check.json [--markdown]
[--figure out.png]``: from the ``paper`` section of a ``scripts/gpu-check
--scenario paper`` run (a device's, ``--device cpu``'s or a dry run's): per
policy and rate the requests, the measured attainment and the simulator's
prediction beside it; each policy's sustainable rate at 90%, aegaeon's ratio
to it, what a switch cost it (measured) and the models per device at the
paper's 0.1 RPS; the figure: attainment against RPS per model, one line per
policy, its prediction dashed. Standard library only at the top (matplotlib
for the figure alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PERCENT = 100.0


def pct(value: Any) -> str:
    return "-" if value is None else f"{PERCENT * float(value):.1f}%"


def rate_text(entry: Mapping[str, Any] | None) -> str:
    """A sustainable rate (``paper_stats.sustainable_rate``) in words."""
    entry = entry or {}
    value, kind = entry.get("rps_per_model"), entry.get("kind")
    if value is None:
        bound = entry.get("upper_bound")
        return f"< {bound:.4g}" if bound is not None else "none"
    return f"{'>= ' if kind == 'at_least' else ''}{value:.4g}"


def ratio_text(ratio: Mapping[str, Any] | None) -> str:
    ratio = ratio or {}
    value = ratio.get("value")
    if value is None:
        return "-"
    prefix = {"at_least": ">= ", "at_most": "<= "}.get(str(ratio.get("kind")), "")
    return f"{prefix}{value:.2f}x"


def _predicted(paper: Mapping[str, Any]) -> dict[str, dict[float, float]]:
    sim = (paper.get("predicted") or {}).get("policies") or {}
    return {p: {float(q["rps_per_model"]): q.get("predicted") for q in e.get("points") or []}
            for p, e in sim.items()}  # fmt: skip


def rows(paper: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per measured (policy, rate), in rate order within each policy."""
    predicted = _predicted(paper)
    out = []
    for policy in paper.get("policies") or list(paper.get("runs") or {}):
        for run in sorted((paper.get("runs") or {}).get(policy) or [],
                          key=lambda r: float(r["rps_per_model"])):  # fmt: skip
            rate = float(run["rps_per_model"])
            out.append({"policy": policy, "rps_per_model": rate,
                        "requests": run.get("requests"), "measured": run.get("slo_attainment"),
                        "predicted": predicted.get(policy, {}).get(rate)})  # fmt: skip
    return out


def headline(paper: Mapping[str, Any]) -> str:
    slo = paper.get("slo") or {}
    gpu = (paper.get("gpu") or {}).get("name")
    machine = paper.get("machine") or {}
    device = gpu or f"CPU ({machine.get('cpu') or 'unknown'}, {machine.get('cpu_count')} cores)"
    cap = paper.get("device_memory_cap_bytes")
    models = paper.get("models") or []
    dtype = next((m.get("dtype") for m in models if m.get("dtype")), "")
    kind = f", {dtype}" if dtype else ""
    capped = f", device memory {cap / (1 << 30):.2f} GiB per instance" if cap else ""
    return (f"paper: {paper.get('models_per_gpu')} models on one {device} "
            f"({(paper.get('model_bytes_total') or 0) / 1e9:.2f} GB of weights{kind}{capped}), "
            f"TTFT {slo.get('ttft_s')} s / TPOT {1000 * float(slo.get('tbt_s') or 0):.0f} ms"
            + (f" ({slo['scaled']})" if slo.get("scaled") else ""))


def policy_lines(paper: Mapping[str, Any]) -> list[str]:
    """Per policy: its sustainable rate (measured and simulated), aegaeon's ratio to it,
    its switches and what each cost, models per device at the paper's rate."""
    sustainable = paper.get("sustainable") or {}
    ratios = paper.get("ratios") or {}
    sim = paper.get("predicted") or {}
    sim_policies = sim.get("policies") or {}
    per_gpu = paper.get("models_per_gpu_at_paper_rps") or {}
    plan = paper.get("rate_plan") or {}
    out = []
    for policy in paper.get("policies") or list(sustainable):
        switches = (paper.get("switches") or {}).get(policy) or {}
        sim_entry = sim_policies.get(policy) or {}
        line = (f"{policy}: sustainable at 90% {rate_text(sustainable.get(policy))} "
                f"(simulated: {rate_text(sim_entry.get('sustainable'))})")
        if policy in ratios:
            line += (f"; aegaeon / it {ratio_text(ratios[policy])} (simulated: "
                     f"{ratio_text((sim.get('ratios') or {}).get(policy))})")
        if switches:
            line += (f"; {switches.get('records')} switches, "
                     f"{switches.get('visible_ms_mean') or 0:.1f} ms visible each "
                     f"({switches.get('prefetched')} prefetched, {switches.get('resident')} "
                     f"in place), {switches.get('charged_s') or 0:.2f} s charged")
        if per_gpu.get(policy) is not None:
            line += f"; {per_gpu[policy]} models at 0.1 RPS"
        out.append(line)
    for policy, why in (plan.get("left_out") or {}).items():
        out.append(f"{policy}: not run: {why}")
    for skipped in plan.get("skipped") or []:
        out.append(f"{skipped['policy']} at {skipped['rps_per_model']:.4g}: not run: "
                   f"{skipped['why']}")
    return out


def markdown(paper: Mapping[str, Any]) -> str:
    """The table for docs/results.md: the runs, then one line per policy."""
    lines = [f"{headline(paper)}", "",
             "| policy | RPS per model | requests | attainment | simulated |",
             "|---|---|---|---|---|"]  # fmt: skip
    for row in rows(paper):
        lines.append(f"| {row['policy']} | {row['rps_per_model']:.4g} | {row['requests']} | "
                     f"{pct(row['measured'])} | {pct(row['predicted'])} |")
    sustainable = paper.get("sustainable") or {}
    sim = (paper.get("predicted") or {}).get("policies") or {}
    ratios = paper.get("ratios") or {}
    lines += ["", "| policy | sustainable at 90% (simulated) | aegaeon / it | a switch, "
              "measured | models at 0.1 RPS |", "|---|---|---|---|---|"]
    for policy in paper.get("policies") or list(sustainable):
        switches = (paper.get("switches") or {}).get(policy) or {}
        records = switches.get("records") or 0
        charged = switches.get("charged_s") or 0.0
        cost = (f"{switches.get('visible_ms_mean') or 0:.1f} ms visible x {records}"
                + (f" ({1000 * charged / records:.0f} ms of it charged)" if charged and records
                   else "")) if records else "none"  # fmt: skip
        lines.append(
            f"| {policy} | {rate_text(sustainable.get(policy))} "
            f"({rate_text((sim.get(policy) or {}).get('sustainable'))}) | "
            f"{ratio_text(ratios.get(policy)) if policy in ratios else '-'} | {cost} | "
            f"{(paper.get('models_per_gpu_at_paper_rps') or {}).get(policy) or '-'} |")
    return "\n".join(lines)


def figure(paper: Mapping[str, Any], out: Path, title: str | None = None) -> Path:
    """Attainment against RPS per model, a line per policy (measured: solid with its runs,
    simulated: dashed); the 90% target dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    predicted = _predicted(paper)
    for i, policy in enumerate(paper.get("policies") or []):
        color = colors[i % len(colors)]
        runs = sorted((float(r["rps_per_model"]), r["slo_attainment"])
                       for r in (paper.get("runs") or {}).get(policy) or []
                       if r.get("slo_attainment") is not None)  # fmt: skip
        if runs:
            ax.plot([r for r, _ in runs], [PERCENT * a for _, a in runs], "o-", color=color,
                    label=f"{policy} (measured)")
        sim = sorted((r, a) for r, a in predicted.get(policy, {}).items() if a is not None)
        if sim:
            ax.plot([r for r, _ in sim], [PERCENT * a for _, a in sim], "--", color=color,
                    alpha=0.8, label=f"{policy} (simulated)")
    ax.axhline(90.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("RPS per model")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.set_title(title or headline(paper).split(", TTFT")[0], fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paper_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", type=Path, help="a gpu-check.json of --scenario paper")
    parser.add_argument("--markdown", action="store_true", help="print the markdown tables")
    parser.add_argument("--figure", type=Path, help="write the figure (PNG) here")
    parser.add_argument("--title", help="the figure's title (default: the headline)")
    args = parser.parse_args(argv)
    try:
        paper = json.loads(args.summary.read_text())["paper"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"paper_report: {args.summary}: no paper section ({exc})", file=sys.stderr)
        return 2
    if args.markdown:
        print(markdown(paper))
    else:
        print(headline(paper))
        for line in policy_lines(paper):
            print("  " + line)
    if args.figure is not None:
        print(f"wrote {figure(paper, args.figure, args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
