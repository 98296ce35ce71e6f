"""``aegaeon bench soak``: a long mixed load, then did any process grow?

Starts ``aegaeon serve`` and runs, for ``--warmup`` then ``--duration``
seconds: ``--concurrency`` clients streaming completions over every model
(closed loop), and beside them, every ``--chaff-interval`` seconds, one of: a
non-streamed completion, a stream dropped mid-way, a malformed request, a
request with an unknown model, ``/v1/models``, ``/metrics``,
``/v1/aegaeon/stats``. After the warm-up (every model served, every pool
and cache at its working size) it records each process's resident memory
(RSS) and open file descriptors and the run's shared-memory segments, again
every ``--sample-interval`` seconds, and at the end, once the node is idle.
It holds when no process's RSS grew 5% or more from the start sample to the
end one, and fds and segments did not grow.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from aegaeon_bench import common

RSS_GROWTH_LIMIT = 0.05


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "soak",
        "a long mixed load: RSS, fds and shm segments of every process, start/end", __doc__)
    parser.add_argument("--duration", type=float, default=600.0, help="s measured (600)")
    parser.add_argument("--warmup", type=float, default=60.0, help="s before the start (60)")
    parser.add_argument("--concurrency", type=int, default=3, help="streaming clients (3)")
    parser.add_argument("--chaff-interval", type=float, default=0.5,
                        help="s between the other requests (0.5)")
    parser.add_argument("--sample-interval", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    common.add_own_node_arguments(parser)
    parser.set_defaults(func=run)


async def _chaff(session: aiohttp.ClientSession, base_url: str, models: list[str],
                 rng: random.Random, interval_s: float, counts: Counter[str]) -> None:  # fmt: skip
    """The other traffic of a soak, one request every ``interval_s``."""
    from aegaeon_bench.reliability.chaos_load import request_body

    url = f"{base_url}/v1/completions"
    kinds = ["plain", "dropped", "malformed", "unknown_model", "models", "metrics", "stats"]
    while True:
        kind = rng.choice(kinds)
        try:
            if kind == "plain":
                body = request_body(rng.choice(models), rng, rng.randint(2, 16), 30.0, False)
                async with session.post(url, json=body) as resp:
                    await resp.read()
            elif kind == "dropped":
                body = request_body(rng.choice(models), rng, 48, 30.0)
                async with session.post(url, json=body) as resp:
                    await resp.content.readline()
                    resp.close()
            elif kind == "malformed":
                async with session.post(url, data=rng.choice([b"{", b"[]", b"\xff\xfe", b'{"x":1}'])
                                        ) as resp:  # fmt: skip
                    await resp.read()
            elif kind == "unknown_model":
                async with session.post(url, json={"model": "nope", "prompt": "x"}) as resp:
                    await resp.read()
            else:
                path = {"models": "/v1/models", "metrics": "/metrics",
                        "stats": "/v1/aegaeon/stats"}[kind]  # fmt: skip
                async with session.get(base_url + path) as resp:
                    await resp.read()
            counts[kind] += 1
        except (aiohttp.ClientError, TimeoutError):
            counts[f"{kind}_client_error"] += 1
        await asyncio.sleep(interval_s)


def _snapshot(serve_pid: int, run_dir: Path, t0: float) -> dict[str, Any]:
    from aegaeon_bench.node.probe import sample_processes, shm_segments

    return {
        "t_s": round(time.time() - t0, 1),
        "processes": {n: {"pid": s.pid, "rss_bytes": s.rss_bytes, "fds": s.num_fds}
                      for n, s in sorted(sample_processes(serve_pid).items())},
        "shm_segments": len(shm_segments(run_dir)),
    }  # fmt: skip


async def soak(base_url: str, serve_pid: int, run_dir: Path,
               args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    from aegaeon_bench.node.client import auth_headers, list_models
    from aegaeon_bench.node.probe import wait_quiet
    from aegaeon_bench.reliability.chaos_load import LoadDriver

    rng = random.Random(args.seed)
    t0 = time.time()
    timeout = aiohttp.ClientTimeout(total=120)
    headers = auth_headers(common.api_key(args))
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        models = await list_models(session, base_url)
        driver = LoadDriver(base_url, models, args.concurrency, seed=args.seed)
        counts: Counter[str] = Counter()
        load = asyncio.create_task(driver.run(session))
        chaff = asyncio.create_task(_chaff(session, base_url, models, rng,
                                           args.chaff_interval, counts))  # fmt: skip
        await asyncio.sleep(args.warmup)
        samples = [_snapshot(serve_pid, run_dir, t0)]
        end = time.time() + args.duration
        while time.time() < end:
            await asyncio.sleep(min(args.sample_interval, max(0.0, end - time.time())))
            samples.append(_snapshot(serve_pid, run_dir, t0))
        driver.stop()
        chaff.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await chaff
        await load
        held = await wait_quiet(session, base_url, 60.0)
    final = _snapshot(serve_pid, run_dir, t0)
    start = samples[0]
    growth = {}
    for name, first in start["processes"].items():
        last = final["processes"].get(name)
        if last is None or last["pid"] != first["pid"]:
            growth[name] = {"restarted": True}
            continue
        growth[name] = {
            "rss_start_mib": round(first["rss_bytes"] / 2**20, 1),
            "rss_end_mib": round(last["rss_bytes"] / 2**20, 1),
            "rss_peak_mib": round(max(s["processes"].get(name, {}).get("rss_bytes", 0)
                                      for s in samples) / 2**20, 1),
            "rss_growth": round(last["rss_bytes"] / first["rss_bytes"] - 1.0, 4),
            "fds_start": first["fds"],
            "fds_end": last["fds"],
        }  # fmt: skip
    outcomes = Counter(a.outcome for a in driver.attempts)
    ok = (all("rss_growth" in g and g["rss_growth"] < RSS_GROWTH_LIMIT
              and g["fds_end"] <= g["fds_start"] for g in growth.values())
          and final["shm_segments"] <= start["shm_segments"] and held.quiet
          and outcomes.get("hung", 0) == 0)  # fmt: skip
    return {
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "streams": {"sent": len(driver.attempts), **dict(outcomes)},
        "other_requests": dict(counts),
        "processes": growth,
        "shm_segments": {"start": start["shm_segments"], "end": final["shm_segments"]},
        "holdings_after": held.to_dict(),
        "samples": [*samples, final],
        "ok": ok,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{'process':<11} {'RSS start':>10} {'RSS end':>10} {'growth':>7} {'peak':>8} "
             f"{'fds':>9}"]  # fmt: skip
    for name, g in report["processes"].items():
        if "rss_growth" not in g:
            lines.append(f"{name:<11} restarted during the soak")
            continue
        lines.append(f"{name:<11} {g['rss_start_mib']:>7.1f} MiB {g['rss_end_mib']:>6.1f} MiB "
                     f"{g['rss_growth'] * 100:>6.2f}% {g['rss_peak_mib']:>6.1f} M "
                     f"{g['fds_start']:>4}->{g['fds_end']:<4}")  # fmt: skip
    shm = report["shm_segments"]
    lines.append(f"shm segments {shm['start']} -> {shm['end']}; streams {report['streams']}; "
                 f"after: {report['holdings_after']}; {'OK' if report['ok'] else 'FAILED'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.process import run_fast

    from aegaeon_bench.node.launch import start_bench_node

    node = start_bench_node("soak", common.node_market(args), args.config)
    if node is None:
        return 1
    try:
        assert node.run_dir is not None
        report = run_fast(soak(node.url, node.proc.pid, node.run_dir, args))
    finally:
        node.stop()
    report = {**common.machine_info(), **report}
    print(format_report(report))
    return common.emit_report(args, report)
