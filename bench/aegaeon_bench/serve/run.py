"""The open-loop run of `bench serve`: send each request at its arrival, whatever came before.

One asyncio loop: a dispatcher sleeps until each planned arrival and starts
that request's stream as its own task (it never waits for earlier ones); a
sampler reads ``/v1/aegaeon/stats`` about every second for the KV cache time
series; at the end of the run plus a grace period every request still open
is cancelled and counts as failed (the tokens it did get still count).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aegaeon_workload.plan import PlannedRequest
from aegaeon_workload.trace import TraceRecord, kv_sample

from aegaeon_bench.node.client import (
    Progress,
    ServiceError,
    auth_headers,
    get_stats,
    stream_completion,
)
from aegaeon_bench.report.metrics import token_times

START_DELAY_S = 0.5  # between planning the clock and the first possible arrival
STATS_TIMEOUT_S = 30.0
REFUSED = (401, 403)  # the stats need an admin key the bench was not given


@dataclass(frozen=True)
class RunOptions:
    base_url: str
    duration_s: float
    grace_s: float = 30.0
    sample_interval_s: float = 1.0
    timeout_s: float | None = None  # each request's own deadline (None: the server's)
    api_key: str | None = field(default=None, repr=False)  # sent with every request


@dataclass
class RunOutcome:
    """What a run leaves: the requests' progress and the services' view."""

    progress: list[Progress]
    stats_before: dict[str, Any] | None
    stats_after: dict[str, Any] | None
    kv_samples: list[dict[str, Any]] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0

    def records(self) -> list[TraceRecord]:
        """Every request as a trace record, in arrival order."""
        return [_record(p) for p in self.progress]


def _record(p: Progress) -> TraceRecord:
    return TraceRecord(
        request_id=p.planned.request_id, model=p.planned.model, arrival_s=p.arrival_s,
        token_times_s=tuple(token_times(p.event_times_s, p.num_tokens, p.finish_s)),
        expected_tokens=p.planned.max_tokens, status="ok" if p.ok else "failed",
        sent_s=p.sent_s, prompt_tokens=p.planned.prompt_len, num_events=len(p.event_times_s),
        error=p.error, server_id=p.server_id,
    )  # fmt: skip


async def _sample_kv(
    session: aiohttp.ClientSession, options: RunOptions, samples: list[dict[str, Any]]
) -> None:
    """Append a KV sample about every ``sample_interval_s`` until cancelled."""
    while True:
        started = time.monotonic()
        try:
            stats = await get_stats(session, options.base_url, light=True)
            if stats is None:
                return  # the backend keeps none
            samples.append(kv_sample(stats, time.time()))
        except ServiceError as exc:
            if exc.status in REFUSED:
                return  # they need an admin key
        except (aiohttp.ClientError, TimeoutError):
            pass  # the next one, then
        await asyncio.sleep(max(0.0, options.sample_interval_s - (time.monotonic() - started)))


async def _stats(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any] | None:
    """The node's stats; None where it keeps none, or where they need an admin key and
    the bench has a user key (the load runs all the same, without the node's counters)."""
    try:
        async with asyncio.timeout(STATS_TIMEOUT_S):
            return await get_stats(session, base_url)
    except ServiceError as exc:
        if exc.status in REFUSED:
            return None
        raise


async def run_load(planned: Sequence[PlannedRequest], options: RunOptions, *,
                   on_done: Callable[[Progress], None] | None = None) -> RunOutcome:  # fmt: skip
    """Run the plan against ``options.base_url``; ``on_done`` is told of each ended request."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: no client-side queue
    headers = auth_headers(options.api_key)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     headers=headers) as session:  # fmt: skip
        outcome = RunOutcome([], await _stats(session, options.base_url), None)
        samples = outcome.kv_samples
        sampler = asyncio.create_task(_sample_kv(session, options, samples))
        start_s = time.time() + START_DELAY_S
        outcome.start_s = start_s
        tasks: list[asyncio.Task[None]] = []

        async def one(progress: Progress) -> None:
            try:
                await stream_completion(session, options.base_url, progress, options.timeout_s)
            finally:
                if on_done is not None:
                    on_done(progress)

        for request in planned:
            arrival_s = start_s + request.offset_s
            delay_s = arrival_s - time.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            progress = Progress(request, arrival_s)
            outcome.progress.append(progress)
            tasks.append(asyncio.create_task(one(progress)))
        deadline_s = start_s + options.duration_s + options.grace_s
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline_s - time.time()))
        for task, progress in zip(tasks, outcome.progress, strict=True):
            if not task.done():
                progress.error = "unfinished at the end of the run plus the grace period"
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        outcome.end_s = time.time()
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        for result in results:
            if isinstance(result, Exception):
                raise result  # a bug, not a failed request: stream_completion keeps those
        outcome.stats_after = await _stats(session, options.base_url)
    return outcome
