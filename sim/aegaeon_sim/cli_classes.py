"""``aegaeon sim --compare classes|roles``: issue 19's side-by-side figures, simulated.

``classes``: a class mix (default 30/70 interactive/batch) at ``--load`` x
the cluster's capacity (``--capacity-rps`` per model: the rate the paper-layout
Aegaeon serves at >= 99% with one SLO), the same trace through

- ``single``: the single-SLO scheduler (requests carry no class; the
  proxy's admission at its bounds, past them a 429);
- ``multi``: SLO classes (deadline-ordered prefill groups, per-batch TBT,
  shedding by class through :class:`aegaeon_sched.Shedder`) with the
  deployment's ``max_deferred`` (256);
- ``multi-defer-all``: the same, every batch request that does not fit
  deferred rather than refused (``max_deferred`` unbounded);

each scored per class against the class's targets (interactive: TTFT 0.5x,
TBT 1x the SLO; batch: 5x and 4x). The KV admission bound is the operator's
(``proxy.max_kv_blocks``), sized to what is in flight at capacity
(Little's law over a run at ``--capacity-rps``); the prefill bound is derived.

``roles``: ON/OFF bursts (``--burst``, TokenScale's shape: seconds-long, 10x),
the same trace through ``fixed`` (the paper's 6 prefill + 10 decode),
``fixed-hybrid`` (prefill instances decode when idle, the live default) and
``dynamic`` (every instance prefill- and decode-capable, roles moved by
:class:`aegaeon_sched.RoleController`): attainment, TTFT/TBT p99, role
changes, and how long each burst's prefill backlog took to drain
(:func:`aegaeon_sim.roles_feed.absorb_times`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from aegaeon_workload.mix import format_mix, parse_burst, parse_mix

if TYPE_CHECKING:  # the runner loads the instance loops (torch): when a scenario runs
    from aegaeon_sim.runner import Scenario, ScenarioResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--class-mix", default="interactive=0.3,batch=0.7",
                        help="with --compare classes")  # fmt: skip
    parser.add_argument("--capacity-rps", type=float, default=1.6,
                        help="with --compare classes: the capacity, RPS per model (1.6 at 40 "
                        "models: 99.6%% attainment with one SLO)")  # fmt: skip
    parser.add_argument("--load", type=float, default=1.5,
                        help="with --compare classes: x capacity (1.5)")  # fmt: skip
    parser.add_argument("--burst", default="on=5,period=30,factor=10,first=10",
                        help="with --compare roles: ON/OFF shape, --rps the OFF rate")  # fmt: skip


def _report(r: ScenarioResult) -> dict[str, Any]:
    rep = r.report
    out: dict[str, Any] = {
        "attainment": round(rep.attainment, 4),
        "requests": rep.num_requests,
        "ttft_p99_s": round(rep.ttft_p99_s, 3),
        "tbt_p99_s": round(rep.tbt_p99_s, 4),
        "wall_s": round(r.wall_s, 1),
    }
    if r.by_class:
        out["by_class"] = {
            name: {
                "attainment": round(c.attainment, 4),
                "requests": c.num_requests,
                "completed": c.num_requests - c.num_failed - c.num_unfinished,
                "refused": c.num_failed,
                "unfinished": c.num_unfinished,
                "ttft_p99_s": round(c.ttft_p99_s, 3),
                "tbt_p99_s": round(c.tbt_p99_s, 4),
            }
            for name, c in r.by_class.items()
        }
        out["admission"] = r.admission
    if r.absorb:
        times = [a.absorbed_s for a in r.absorb]
        done = [t for t in times if t is not None]
        out["role_changes"] = r.role_changes
        out["absorb_s"] = times
        out["absorb_mean_s"] = round(statistics.mean(done), 2) if done else None
        out["peak_backlog_tokens"] = [a.peak_backlog_tokens for a in r.absorb]
    return out


def print_progress(args: argparse.Namespace, line: str) -> None:
    """A progress line on stderr, unless ``--quiet``."""
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


def kv_bound_at(base: Scenario, rps: float) -> int:
    """KV blocks in flight at ``rps`` (Little's law: arrival rate x mean time in the
    system x mean blocks per request), from a single-SLO run with no admission."""
    from aegaeon_sim.hardware import market
    from aegaeon_sim.runner import run_scenario, workload

    sc = replace(base, rps_per_model=rps, class_mix=(), admission=False, roles=False, burst=None)
    requests, _ = workload(sc, tuple(market(sc.num_models)))
    r = run_scenario(sc, keep_traces=True)
    spans = [t.token_times_s[-1] - t.arrival_s for t in r.traces if t.token_times_s]
    if not requests or not spans:
        return 1
    blocks = statistics.mean(-(-(q.prompt_len + q.max_tokens) // 16) for q in requests)
    return max(1, int(len(requests) / sc.duration_s * statistics.mean(spans) * blocks))


def compare(args: argparse.Namespace, base: Scenario) -> dict[str, Any]:
    base = replace(base, num_models=args.models)
    if args.compare == "classes":
        mix = parse_mix(args.class_mix)
        rps = args.capacity_rps * args.load
        bound = kv_bound_at(base, args.capacity_rps)
        common = replace(base, rps_per_model=rps, class_mix=mix, admission=True,
                         kv_blocks_bound=bound)  # fmt: skip
        runs = {
            "single": replace(common, slo_classes=False),
            "multi": common,
            "multi-defer-all": replace(common, max_deferred=1 << 30),
        }
        head: dict[str, Any] = {"class_mix": format_mix(mix), "capacity_rps": args.capacity_rps,
                                "load": args.load, "rps_per_model": rps,
                                "kv_blocks_bound": bound}  # fmt: skip
    else:
        burst = parse_burst(args.burst)
        common = replace(base, rps_per_model=args.rps, burst=burst)
        runs = {
            "fixed": common,
            "fixed-hybrid": replace(common, hybrid_prefill=True),
            "dynamic": replace(common, roles=True),
        }
        head = {"burst": asdict(burst), "rps_off": args.rps, "mean_rps": args.rps *
                burst.mean_factor()}  # fmt: skip
    from aegaeon_sim.runner import run_scenario

    results: dict[str, Any] = {}
    for name, sc in runs.items():
        print_progress(args, f"{args.compare}: {name} ...")
        results[name] = _report(run_scenario(sc, tbt_percentiles=True))
        _print(name, results[name])
    return {"compare": args.compare, "models": args.models, "seed": base.seed,
            "duration_s": base.duration_s, "slo": asdict(base.slo), **head,
            "runs": results}  # fmt: skip


def _print(name: str, rep: dict[str, Any]) -> None:
    line = (f"{name:16s} attainment {100 * rep['attainment']:5.1f}%  TTFT p99 "
            f"{rep['ttft_p99_s']:.2f} s  TBT p99 {1e3 * rep['tbt_p99_s']:.0f} ms")  # fmt: skip
    for cls, c in rep.get("by_class", {}).items():
        line += (f"\n    {cls:12s} {100 * c['attainment']:5.1f}%  completed "
                 f"{c['completed']}/{c['requests']} (refused {c['refused']})  "
                 f"TTFT p99 {c['ttft_p99_s']:.1f} s")  # fmt: skip
    if "absorb_s" in rep:
        line += (f"\n    role changes {rep['role_changes']}, burst absorbed in "
                 f"{rep['absorb_s']} s (mean {rep['absorb_mean_s']}), peak backlog "
                 f"{rep['peak_backlog_tokens']}")  # fmt: skip
    print(line, flush=True)
