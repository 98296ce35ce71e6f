"""``aegaeon bench overload --clients 1,4,256``: clients that ignore ``Retry-After``.

Closed loop, as GuideLLM's throughput mode and ``vllm bench serve
--max-concurrency`` drive a server: each of N clients sends a completion,
waits for its end, and sends the next at once, a 429 included (no back-off).
For each N in turn, on the same node, after ``warmup`` seconds of load:
completed requests per second over ``duration`` seconds, refusals, and what
was still open at the end. The clients run in this process, on the node's
cores, as a benchmark client does. Goodput holds when the largest N
completes at least ``GOODPUT_HELD`` x the best of the others (one client at a
time is what the node does undisturbed).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from aegaeon_bench.node.client import auth_headers

GOODPUT_HELD = 0.9
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "it",
         "rains", "on", "the", "hills")  # fmt: skip


@dataclass
class _Tally:
    completed_at: list[float] = field(default_factory=list)
    refused: int = 0
    errors: int = 0
    other: int = 0


async def closed_loop(base_url: str, model: str, clients: int, *, duration_s: float,
                      warmup_s: float, prompt_words: int, max_tokens: int,
                      seed: int = 0, api_key: str | None = None) -> dict[str, Any]:  # fmt: skip
    """``clients`` closed-loop clients for ``warmup_s + duration_s``: the row of one N."""
    import aiohttp

    tally = _Tally()
    start = time.monotonic()
    stop_at = start + warmup_s + duration_s

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.monotonic() < stop_at:
            prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": True}  # fmt: skip
            try:
                async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        tally.completed_at.append(time.monotonic() - start)
                    elif resp.status == 429:
                        tally.refused += 1  # and at once again: Retry-After ignored
                    else:
                        tally.other += 1
            except aiohttp.ClientError:
                tally.errors += 1
                await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    headers = auth_headers(api_key)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as session:  # fmt: skip
        tasks = [asyncio.create_task(client(session, random.Random(seed * 100_003 + i)))
                 for i in range(clients)]  # fmt: skip
        await asyncio.sleep(warmup_s + duration_s)
        open_at_end = sum(1 for t in tasks if not t.done())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    done = [t for t in tally.completed_at if warmup_s <= t <= warmup_s + duration_s]
    return {"clients": clients, "completed": len(done),
            "completed_per_s": len(done) / duration_s, "refused": tally.refused,
            "errors": tally.errors, "other": tally.other, "open_at_end": open_at_end}  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest N's completions against the best of the smaller ones."""
    flood, others = rows[-1], rows[:-1]
    best = max((r["completed_per_s"] for r in others), default=0.0)
    ratio = flood["completed_per_s"] / best if best > 0 else None
    return {"clients": rows, "goodput_ratio": ratio,
            "ok": ratio is not None and ratio >= GOODPUT_HELD and flood["other"] == 0}


def format_rows(report: dict[str, Any]) -> str:
    lines = [f"{'clients':>7} {'done/s':>7} {'done':>5} {'429':>6} {'errors':>6} {'open':>5}"]
    for r in report["clients"]:
        lines.append(f"{r['clients']:>7} {r['completed_per_s']:>7.3f} {r['completed']:>5} "
                     f"{r['refused']:>6} {r['errors'] + r['other']:>6} {r['open_at_end']:>5}")
    ratio = report["goodput_ratio"]
    lines.append(f"completed/s at {report['clients'][-1]['clients']} clients / the best of "
                 f"fewer: {'n/a' if ratio is None else f'{ratio:.2f}'} (held: >= "
                 f"{GOODPUT_HELD}); {'OK' if report['ok'] else 'NOT held'}")
    return "\n".join(lines)
