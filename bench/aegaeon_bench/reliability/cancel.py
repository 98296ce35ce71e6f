"""``aegaeon bench cancel``: streamed requests dropped by their clients at random points,
then nothing may be left behind.

Starts ``aegaeon serve`` (or uses ``--url`` with ``--no-node``) and sends
``--requests`` streamed completions, ``--concurrency`` at a time, over every
model; each client disconnects at a point drawn from the seed: before the
answer starts, after the k-th event (k below the request's ``max_tokens``), or
not at all (a few finish, as a control). Once all are done the node must go
back to holding nothing within ``--settle`` seconds: ``open_requests`` 0 and,
on every instance, ``kv_blocks_in_use``, ``leases`` and ``open_sequences`` 0
(``/v1/aegaeon/stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from typing import Any

import aiohttp

from aegaeon_bench import common
from aegaeon_bench.node.http_client import sse_events
from aegaeon_bench.reliability.chaos_load import request_body

__all__ = ["cancel_run"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "cancel",
        "streams dropped at random points: 0 KV blocks, leases, sequences left", __doc__)
    parser.add_argument("--requests", type=int, default=1000, help="streams to send (1000)")
    parser.add_argument("--concurrency", type=int, default=16, help="at a time (16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request, at most (64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle", type=float, default=60.0,
                        help="s the node may take to free everything (60)")
    parser.add_argument("--url", help="a running proxy instead of starting a node")
    common.add_own_node_arguments(parser)
    parser.set_defaults(func=run)


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               cut_after: int | None, cut_before_s: float | None) -> str:  # fmt: skip
    """Stream one request and drop it as planned; how it went."""

    async def stream() -> str:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return f"http_{resp.status}"
            events = 0
            async for _, event in sse_events(resp):
                if event is None:
                    return "finished"
                events += 1
                if cut_after is not None and events > cut_after:
                    resp.close()  # the client goes away mid-stream
                    return "cut_mid_stream"
            return "stream_ended"

    if cut_before_s is None:
        return await stream()
    task = asyncio.create_task(stream())
    await asyncio.sleep(cut_before_s)
    if task.done():
        return task.result()
    task.cancel()  # the client goes away before (or as) the answer starts
    try:
        await task
    except asyncio.CancelledError:
        return "cut_early"
    return "cut_early"


async def cancel_run(base_url: str, requests: int, concurrency: int, max_tokens: int,
                     seed: int, settle_s: float, *, admin_url: str | None = None,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """``admin_url``: where ``/v1/aegaeon/stats`` is (default ``base_url``); ``headers``:
    sent with every request (an API key)."""
    from aegaeon_bench.node.client import list_models
    from aegaeon_bench.node.probe import read_holdings, wait_quiet

    rng = random.Random(seed)
    url = f"{base_url}/v1/completions"
    admin = admin_url or base_url
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        models = await list_models(session, base_url)
        before = await read_holdings(session, admin)
        plans: list[tuple[dict[str, Any], int | None, float | None]] = []
        for _ in range(requests):
            tokens = rng.randint(4, max_tokens)
            body = request_body(rng.choice(models), rng, tokens, 60.0)
            roll = rng.random()
            if roll < 0.2:
                plans.append((body, None, rng.uniform(0.0, 0.05)))  # before the answer
            elif roll < 0.95:
                plans.append((body, rng.randrange(tokens), None))  # after the k-th event
            else:
                plans.append((body, None, None))  # to the end (control)
        results: Counter[str] = Counter()
        gate = asyncio.Semaphore(concurrency)

        async def run_one(plan: tuple[dict[str, Any], int | None, float | None]) -> None:
            async with gate:
                try:
                    results[await _one(session, url, *plan)] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    results[f"client_error:{type(exc).__name__}"] += 1

        start = time.monotonic()
        await asyncio.gather(*(run_one(p) for p in plans))
        sent_s = time.monotonic() - start
        settle_start = time.monotonic()
        after = await wait_quiet(session, admin, settle_s)
        settled_s = time.monotonic() - settle_start
        stats = await session.get(f"{admin}/v1/aegaeon/stats?light=1")
        counters = (await stats.json()).get("counters", {})
    return {
        "requests": requests,
        "concurrency": concurrency,
        "seed": seed,
        "outcomes": dict(sorted(results.items())),
        "seconds": round(sent_s, 2),
        "settled_in_s": round(settled_s, 2),
        "holdings_before": before.to_dict(),
        "holdings_after": after.to_dict(),
        "per_instance_after": after.per_instance,
        "backend_counters": counters,
        "ok": after.quiet,
    }


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.process import run_fast

    from aegaeon_bench.node.launch import start_bench_node

    node = None
    url = args.url
    if url is None:
        node = start_bench_node("cancel", common.node_market(args), args.config)
        if node is None:
            return 1
        url = node.url
    from aegaeon_bench.node.client import auth_headers

    headers = auth_headers(common.api_key(args))
    try:
        report = run_fast(cancel_run(url.rstrip("/"), args.requests, args.concurrency,
                                     args.max_tokens, args.seed, args.settle,
                                     headers=headers))  # fmt: skip
    finally:
        if node is not None:
            node.stop()
    report = {**common.machine_info(), **report}
    held = report["holdings_after"]
    print(f"{report['requests']} streams in {report['seconds']} s: {report['outcomes']}; "
          f"after {report['settled_in_s']} s: open requests {held['open_requests']}, KV blocks "
          f"{held['kv_blocks_in_use']}, leases {held['leases']}, sequences "
          f"{held['open_sequences']}; {'OK' if report['ok'] else 'LEAKED'}")  # fmt: skip
    return common.emit_report(args, report)
