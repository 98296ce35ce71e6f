"""``aegaeon bench report``: pictures of a `bench serve` run (and of a sweep).

From ``TRACE`` (``bench serve --trace``) and the files beside it
(``.stats.json``, ``.kv.jsonl``, ``.summary.json``), written to ``--out``:

- ``breakdown.png``: share of request time in prefill wait, prefill, decode
  wait, decode and KV overhead, from the services' timings (paper Fig. 14);
- ``switch_cdf.png``: CDF of model-switch latency, prefetched or not (Fig. 15 left);
- ``kv_fragmentation.png``: unified CPU KV cache fragmentation over time,
  overall and per shape, and its usage (Fig. 16);
- ``timeline.png``: every request's tokens against their deadlines (Fig. 3);
- ``attainment.png``: per-model attainment and qos, TTFT and TBT CDFs;
- ``sweep.png`` with ``--sweep FILE`` (``aegaeon_bench.report.sweep_schema``):
  attainment against the number of models, one line per policy.

The SLO targets are the run's (its summary), unless ``--ttft``/``--tbt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aegaeon_bench import common
from aegaeon_bench.report.plotting import PlotsUnavailableError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``report`` parser."""
    parser = common.add_bench(
        sub, "report", "PNG figures of a bench serve trace (and a sweep)", __doc__)
    parser.add_argument("trace", type=Path, nargs="?", help="a bench serve --trace file")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    parser.add_argument("--sweep", type=Path, help="a bench sweep JSON file")
    parser.add_argument("--ttft", type=float, help="TTFT target, s (default: the run's)")
    parser.add_argument("--tbt", type=float, help="TBT target, s (default: the run's)")
    parser.set_defaults(func=run)


def write_report(trace: Path | None, out: Path, *, sweep: Path | None = None,
                 ttft_s: float | None = None, tbt_s: float | None = None) -> list[Path]:
    """Write every figure the inputs allow; returns the paths written (PlotsUnavailableError
    without matplotlib)."""
    from aegaeon_bench.report.plotting import use_agg

    use_agg()
    from aegaeon_bench.report.data import load_run
    from aegaeon_bench.report.plots import plot_breakdown, plot_kv, plot_switch_cdf
    from aegaeon_bench.report.sweep_schema import load_sweep
    from aegaeon_bench.report.timeline import plot_attainment, plot_sweep, plot_timeline

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if trace is not None:
        data = load_run(trace)
        slo = data.slo(ttft_s, tbt_s)
        written += [
            plot_breakdown(data, out / "breakdown.png"),
            plot_switch_cdf(data, out / "switch_cdf.png"),
            plot_kv(data, out / "kv_fragmentation.png"),
            plot_timeline(data, slo, out / "timeline.png"),
            plot_attainment(data, slo, out / "attainment.png"),
        ]
    if sweep is not None:
        written.append(plot_sweep(load_sweep(sweep), out / "sweep.png"))
    return written


def run(args: argparse.Namespace) -> int:
    if args.trace is None and args.sweep is None:
        print("aegaeon bench report: give a TRACE, a --sweep, or both", file=sys.stderr)
        return 2
    try:
        paths = write_report(args.trace, args.out, sweep=args.sweep, ttft_s=args.ttft,
                             tbt_s=args.tbt)  # fmt: skip
    except (OSError, ValueError) as exc:  # SweepError and bad trace lines are ValueErrors
        print(f"aegaeon bench report: {exc}", file=sys.stderr)
        return 1
    except PlotsUnavailableError as exc:
        print(f"aegaeon bench report: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
