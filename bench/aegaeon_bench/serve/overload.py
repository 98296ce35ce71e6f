"""``aegaeon bench overload``: the node at 1x, 2x and 5x the rate it sustains.

Starts ``aegaeon serve`` (``--market``/``--config``) and runs ``bench serve``'s
open-loop Poisson load (``--rps`` per model is 1x: the rate the node sustains,
found beforehand) at each multiple of ``--multiples``, one after another, the
node idle in between. Every request carries its own ``timeout`` (``--timeout``).
Each request ends one way: ``completed``, ``rejected`` (429 at admission, with
``Retry-After``), ``deadline`` (``deadline_exceeded``), or ``other`` (must be
0); ``accounted`` says completed + rejected + deadline == sent. ``goodput`` is
the output tokens that met their SLO deadline (token k by arrival + TTFT + k x
TBT) per second of arrivals; the run holds if goodput at the largest multiple
is >= 80% of goodput at 1x. The proxy's resident memory is sampled every
second (its peak per multiple), and the node must hold nothing once idle.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from aegaeon_bench import common

GOODPUT_HELD = 0.8


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "overload", "1x/2x/5x the sustainable rate: 429s, deadlines, goodput held", __doc__)
    parser.add_argument("--rps", type=float,
                        help="requests/s per model the node sustains (1x); or --clients")
    parser.add_argument("--clients",
                        help="instead of rates: closed-loop clients that ignore Retry-After, "
                        "these counts in turn (e.g. 1,4,256; overload_clients.py)")
    parser.add_argument("--model", help="with --clients: the model (default: the market's "
                        "bench model)")
    parser.add_argument("--warmup", type=float, default=15.0,
                        help="with --clients: s of load before counting (15)")
    parser.add_argument("--prompt-words", type=int, default=200,
                        help="with --clients: words per prompt (200)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="with --clients: tokens per completion (64)")
    parser.add_argument("--multiples", default="1,2,5", help="rates to run, x --rps (1,2,5)")
    parser.add_argument("--models", type=int, default=4, help="first M models (4)")
    parser.add_argument("--duration", type=float, default=60.0, help="s of arrivals per rate")
    common.add_slo_arguments(parser, 2.0, 0.025)
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="each request's own timeout, s (10)")
    parser.add_argument("--input-scale", type=float, default=0.25)
    parser.add_argument("--output-scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    common.add_own_node_arguments(parser)
    parser.set_defaults(func=run)


def classify(progress: Any) -> str:
    """completed | rejected | deadline | other, for one ``serve_client.Progress``."""
    if progress.ok:
        return "completed"
    if progress.status == 429:
        return "rejected"
    if progress.error_code == "deadline_exceeded":
        return "deadline"
    return "other"


async def _sample(base_url: str, serve_pid: int, rss: list[int],
                  held: list[tuple[int, int]], api_key: str | None) -> None:  # fmt: skip
    """Every second: the proxy's RSS, and what admission holds (prefill tokens, KV blocks)."""
    import asyncio
    import contextlib

    import aiohttp

    from aegaeon_bench.node.client import ServiceError, auth_headers, get_stats
    from aegaeon_bench.node.probe import sample_processes

    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers(api_key)) as session:
        while True:
            sample = sample_processes(serve_pid).get("proxy")
            if sample is not None:
                rss.append(sample.rss_bytes)
            with contextlib.suppress(ServiceError, aiohttp.ClientError, TimeoutError):
                adm = ((await get_stats(session, base_url, light=True)) or {}).get("admission")
                if adm:
                    held.append((int(adm["prefill_tokens"]), int(adm["kv_blocks"])))
            await asyncio.sleep(1.0)


async def run_multiple(
    base_url: str, serve_pid: int, models: list[str], limits: dict[str, Any], rps: float,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One rate: the load, the accounting, goodput, the proxy's peak memory."""
    import asyncio
    import contextlib
    from collections import Counter

    import aiohttp
    from aegaeon_sched.slo import SLO, summarize
    from aegaeon_workload.plan import plan_requests

    from aegaeon_bench.node.client import auth_headers
    from aegaeon_bench.node.probe import wait_quiet
    from aegaeon_bench.serve.run import RunOptions, run_load

    planned = plan_requests(models, limits, rps_per_model=rps, duration_s=args.duration,
                            seed=args.seed, input_scale=args.input_scale,
                            output_scale=args.output_scale)  # fmt: skip
    key = common.api_key(args)
    options = RunOptions(base_url, args.duration, grace_s=args.timeout + 15.0,
                         timeout_s=args.timeout, api_key=key)  # fmt: skip
    peaks: list[int] = []
    held_samples: list[tuple[int, int]] = []
    sampler = asyncio.create_task(_sample(base_url, serve_pid, peaks, held_samples, key))
    try:
        outcome = await run_load(planned, options)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    kinds = Counter(classify(p) for p in outcome.progress)
    records = outcome.records()
    report = summarize([r.to_slo() for r in records], SLO(args.ttft, args.tbt))
    span = args.duration
    async with aiohttp.ClientSession(headers=auth_headers(key)) as session:
        held = await wait_quiet(session, base_url, 60.0)
    sent = len(outcome.progress)
    row = {
        "rps_per_model": rps,
        "sent": sent,
        **{k: kinds.get(k, 0) for k in ("completed", "rejected", "deadline", "other")},
        "goodput_tokens_per_s": report.tokens_met / span,
        "throughput_tokens_per_s": sum(len(r.token_times_s) for r in records) / span,
        "completed_per_s": kinds.get("completed", 0) / span,
        "slo_attainment": report.attainment,
        "ttft_p50_s": report.ttft_p50_s,
        "ttft_p99_s": report.ttft_p99_s,
        "proxy_rss_peak_mib": max(peaks, default=0) / 2**20,
        "admitted_peak": {"prefill_tokens": max((h[0] for h in held_samples), default=0),
                          "kv_blocks": max((h[1] for h in held_samples), default=0)},
        "holdings_after": held.to_dict(),
        "other_errors": sorted({p.error_code or p.error or "?" for p in outcome.progress
                                if classify(p) == "other"})[:10],
    }  # fmt: skip
    row["accounted"] = row["completed"] + row["rejected"] + row["deadline"] == sent
    return row


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{'x':>3} {'rps/model':>9} {'sent':>5} {'done':>5} {'429':>5} {'deadline':>8} "
             f"{'other':>5} {'goodput tok/s':>13} {'attain':>6} {'proxy RSS':>9}"]  # fmt: skip
    for row in report["rates"]:
        lines.append(
            f"{row['multiple']:>3g} {row['rps_per_model']:>9.3f} {row['sent']:>5} "
            f"{row['completed']:>5} {row['rejected']:>5} {row['deadline']:>8} {row['other']:>5} "
            f"{row['goodput_tokens_per_s']:>13.1f} {row['slo_attainment'] * 100:>5.1f}% "
            f"{row['proxy_rss_peak_mib']:>6.1f} MiB"
        )
    lines.append(f"goodput at {report['rates'][-1]['multiple']:g}x / 1x: "
                 f"{report['goodput_ratio']:.2f} (held: >= {GOODPUT_HELD}); every request "
                 f"accounted for: {report['accounted']}; {'OK' if report['ok'] else 'FAILED'}")
    return "\n".join(lines)


async def _bounds(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    import aiohttp

    from aegaeon_bench.node.client import auth_headers, get_stats

    async with aiohttp.ClientSession(headers=auth_headers(api_key)) as session:
        stats = await get_stats(session, base_url, light=True)
    return ((stats or {}).get("admission") or {}).get("bounds")


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.process import run_fast
    from aegaeon_workload.plan import model_limits

    from aegaeon_bench.node.client import served_models
    from aegaeon_bench.node.launch import slo_config, start_bench_node

    if (args.rps is None) == (args.clients is None):
        print("aegaeon bench overload: give --rps (open-loop rates) or --clients "
              "(closed-loop clients)", file=sys.stderr)  # fmt: skip
        return 2
    if args.clients is not None and _client_counts(args.clients) is None:
        print("aegaeon bench overload: --clients needs two counts or more, each >= 1 "
              f"(got {args.clients!r})", file=sys.stderr)  # fmt: skip
        return 2
    multiples = [float(x) for x in args.multiples.split(",") if x.strip()]
    market = common.node_market(args)
    root = Path(tempfile.mkdtemp(prefix="aegaeon-overload-"))
    config = slo_config(market, args.config, args.ttft, args.tbt, root)
    node = start_bench_node("overload", market, config, root)
    if node is None:
        return 1

    if args.clients is not None:
        try:
            return _run_clients(args, node, market)
        finally:
            node.stop()

    key = common.api_key(args)

    try:
        models = served_models(node.url, key)[: args.models]
        limits = model_limits(models, market)
        rows: list[dict[str, Any]] = []
        for multiple in multiples:
            row = run_fast(run_multiple(node.url, node.proc.pid, models, limits,
                                        args.rps * multiple, args))  # fmt: skip
            rows.append({"multiple": multiple, **row})
            print(format_report({"rates": rows, "goodput_ratio": 0.0, "accounted": True,
                                 "ok": True}).splitlines()[-2], file=sys.stderr)  # fmt: skip
        bounds = run_fast(_bounds(node.url, key))
    finally:
        node.stop()
    base = next((r for r in rows if r["multiple"] == 1.0), rows[0])
    ratio = rows[-1]["goodput_tokens_per_s"] / max(base["goodput_tokens_per_s"], 1e-9)
    report = {
        **common.machine_info(),
        "settings": common.settings(args),
        "admission_bounds": bounds,
        "rates": rows,
        "goodput_ratio": ratio,
        "accounted": all(r["accounted"] for r in rows),
        "ok": ratio >= GOODPUT_HELD and all(r["accounted"] and r["other"] == 0 for r in rows)
        and all(r["holdings_after"]["open_requests"] == 0 for r in rows),
    }  # fmt: skip
    print(format_report(report))
    return common.emit_report(args, report)


def _run_clients(args: argparse.Namespace, node: Any, market: Path) -> int:
    """``--clients``: closed-loop client counts in turn on the started node."""
    from aegaeon_common.process import run_fast
    from aegaeon_market import default_bench_model

    from aegaeon_bench.serve.overload_clients import closed_loop, format_rows, summarize

    counts = _client_counts(args.clients)
    assert counts is not None  # checked before the node started
    model = args.model or default_bench_model(market).name
    rows = []
    for n in counts:
        row = run_fast(closed_loop(node.url, model, n, duration_s=args.duration,
                                   warmup_s=args.warmup, prompt_words=args.prompt_words,
                                   max_tokens=args.max_tokens, seed=args.seed,
                                   api_key=common.api_key(args)))  # fmt: skip
        rows.append(row)
        print(format_rows(summarize(rows)).splitlines()[-2], file=sys.stderr)
    report = {**common.machine_info(), "model": model,
              "settings": common.settings(args),
              **summarize(rows)}  # fmt: skip
    print(format_rows(report))
    return common.emit_report(args, report)



def _client_counts(spec: str) -> list[int] | None:
    """``--clients``: two counts or more, each >= 1 (None: not so)."""
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        return None
    return counts if len(counts) >= 2 and min(counts) >= 1 else None
