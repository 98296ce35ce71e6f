"""One chaos run: a steady load, faults on a schedule, and what each fault cost.

For each fault, in its own slot of the run: the load runs a while (seeded
jitter), the fault is injected, probes (short requests every ``PROBE_S``)
measure when the node serves again, then the load pauses, the requests open
at the injection end (hung ones are cut by the client and counted), the
node must come back to holding nothing (``/v1/aegaeon/stats``), and the
shared memory, processes and pids are compared with what the fault should
have restarted. The load resumes for the next fault.

Many nodes (``aegaeon serve --nodes N --proxies R``): the load and the probes go
to the replicas in turn, every replica must come back to holding nothing, and
the store's faults add what :mod:`~aegaeon_bench.reliability.store_faults`
checks: the run-time changes kept, when the store and every node's services
are back, and how each request ended against the store's return.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aegaeon_common.owner import STAMP

from aegaeon_bench.node.client import auth_headers, list_models
from aegaeon_bench.node.probe import (
    Holdings,
    serve_children,
    shm_segments,
    stray_processes,
    wait_quiet,
)
from aegaeon_bench.reliability.chaos_load import HANG_MARGIN_S, OUTCOMES, Attempt, LoadDriver, send
from aegaeon_bench.reliability.faults import Fault, ShmFill
from aegaeon_bench.reliability.store_faults import (
    AFTER_S,
    BACK_LIMIT_S,
    SETTLE_S,
    KeptState,
    answers,
    nodes_listed,
    store_of,
    wait_store,
)

PROBE_S = 0.3
PROBE_TIMEOUT_S = 5.0
RECOVERY_LIMIT_S = 180.0  # a fault the node does not recover from within this fails
QUIET_TIMEOUT_S = 30.0
DECODING_WAIT_S = 10.0  # a store fault waits this long at most for a stream decoding

__all__ = ["ChaosNode", "ChaosOptions", "run_chaos"]


@dataclass(frozen=True)
class ChaosNode:
    """A running ``aegaeon serve``: where to reach it and what it runs as; with many
    nodes, its other replicas' URLs and its number of nodes."""

    base_url: str
    run_dir: Path
    serve_pid: int
    replica_urls: tuple[str, ...] = ()
    nodes: int = 1

    @property
    def cluster(self) -> bool:
        return self.nodes > 1 or bool(self.replica_urls)

    @property
    def urls(self) -> tuple[str, ...]:
        return (self.base_url, *self.replica_urls)


@dataclass(frozen=True)
class ChaosOptions:
    faults: Sequence[Fault]
    slot_s: float = 20.0  # per fault: load before and after it
    seed: int = 0
    concurrency: int = 4
    request_timeout_s: float = 30.0
    shm_headroom_bytes: int = 64 << 20
    shm_max_fill_bytes: int | None = None  # None: fill to the headroom
    api_key: str | None = field(default=None, repr=False)  # the node's, when it has keys
    offered_models: tuple[str, ...] = ()  # the market's (a store fault's run adds one)
    # streamed requests (False: plain ones, each status an answer; None: every other one)
    stream: bool | None = True
    max_tokens: tuple[int, int] = (8, 48)  # each request's, drawn between
    # a store fault's "after" load (sent from SETTLE_S past the store's return) ends once
    # this many of its requests are answered, or AFTER_S past SETTLE_S (None: AFTER_S)
    after_answers: int | None = None


@dataclass
class _Probe:
    sent_s: float
    end_s: float
    ok: bool


@dataclass
class _Probes:
    log: list[_Probe] = field(default_factory=list)

    async def run(self, session: aiohttp.ClientSession, urls: Sequence[str], model: str) -> None:
        body = {"model": model, "prompt": "ping", "max_tokens": 2, "timeout": PROBE_TIMEOUT_S}
        while True:
            url = f"{urls[len(self.log) % len(urls)]}/v1/completions"  # (replicas in turn)
            attempt = Attempt(0, model, time.time())
            await send(session, url, body, attempt, PROBE_TIMEOUT_S + 2.0)
            end = attempt.end_s or time.time()
            self.log.append(_Probe(attempt.start_s, end, attempt.outcome == "completed"))
            await asyncio.sleep(max(0.0, PROBE_S - (end - attempt.start_s)))

    def recovery(self, since_s: float) -> tuple[bool, float | None]:
        """(interrupted, seconds from ``since_s`` until probes succeed for good)."""
        after = [p for p in self.log if p.sent_s >= since_s - PROBE_S]
        failed = [p for p in after if not p.ok]
        if not failed:
            first_ok = next((p for p in after if p.ok), None)
            return False, (first_ok.end_s - since_s) if first_ok else None
        last_fail = max(p.sent_s for p in failed)
        ok = [p for p in after if p.ok and p.sent_s > last_fail]
        return True, (ok[0].end_s - since_s) if ok else None

    def serving_again(self, since_s: float) -> bool:
        interrupted, recovery_s = self.recovery(since_s)
        return recovery_s is not None and (
            not interrupted or time.time() - since_s - recovery_s > 2 * PROBE_S
        )


def _children(node: ChaosNode) -> dict[str, Any]:
    return serve_children(node.serve_pid, node.run_dir if node.cluster else None)


def _pids(node: ChaosNode) -> dict[str, int]:
    return {name: proc.pid for name, proc in _children(node).items()}


async def _quiet(session: aiohttp.ClientSession, node: ChaosNode) -> list[Holdings]:
    """What each replica holds once quiet (or at the timeout)."""
    return [await wait_quiet(session, url, QUIET_TIMEOUT_S) for url in node.urls]


def _outcomes(attempts: Sequence[Attempt]) -> dict[str, int]:
    counts = Counter(a.outcome or "hung" for a in attempts)
    return {k: counts.get(k, 0) for k in OUTCOMES}


def _segment_owner(name: str) -> str:
    """The cachemgr pid a segment name carries (``PREFIX-<HOST-TAG.PID>-<hex>-...``: the
    cachemgr's stamp, whose host tag has dashes of its own)."""
    match = STAMP.search(name)
    return match.group("pid") if match else ""


async def _inject(fault: Fault, node: ChaosNode, opts: ChaosOptions) -> dict[str, Any]:
    """Start the fault; returns what was done (for the report)."""
    done: dict[str, Any] = {}
    if fault.action == "fill":
        fill = ShmFill(opts.shm_headroom_bytes, opts.shm_max_fill_bytes)
        await asyncio.to_thread(fill.fill)
        done.update(shm_fill_bytes=fill.nbytes, shm_used_fraction=round(fill.used_fraction, 4),
                    _fill=fill)  # fmt: skip
        return done
    target = _children(node).get(fault.target or "")
    if target is None:
        raise RuntimeError(f"no live {fault.target} to inject {fault.name} into")
    done["target_pid"] = target.pid
    if fault.action == "kill":
        os.kill(target.pid, signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(target.pid, signal.SIGSTOP)
    return done


async def _end(fault: Fault, done: dict[str, Any]) -> None:
    """End a fault that lasts (stop: SIGCONT; fill: remove the file)."""
    if fault.action == "stop":
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(done["target_pid"]), signal.SIGCONT)
    elif fault.action == "fill":
        done.pop("_fill").release()


async def _until_decoding(driver: LoadDriver, limit_s: float) -> None:
    """Until a streamed request of the load has tokens and is still open (at most
    ``limit_s``): the store's faults report whether such streams finish."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if any(a.open and a.first_s is not None for a in driver.attempts[-64:]):
            return
        await asyncio.sleep(0.02)


async def _store_back(node: ChaosNode, session: aiohttp.ClientSession, t0: float,
                      kept: KeptState | None, driver: LoadDriver,
                      after_answers: int | None) -> dict[str, Any]:  # fmt: skip
    """A store fault over: when the store answers, holds the run-time changes again and
    every replica lists every node's services again (seconds from ``t0``); the load
    goes on until the requests sent after :data:`SETTLE_S` are judged (``_back``: when
    the store answered): :data:`AFTER_S` more, or until ``after_answers`` of them are
    answered."""
    url, namespace = store_of(node.run_dir)
    back = await wait_store(url, namespace) or time.time()
    records = await wait_store(url, namespace, kept.keys()) if kept is not None else None
    deadline = time.time() + BACK_LIMIT_S
    while not await nodes_listed(session, node.urls, node.nodes) and time.time() < deadline:
        await asyncio.sleep(0.1)
    listed = time.time() if time.time() < deadline else None
    end = back + SETTLE_S + AFTER_S
    while time.time() < end and not _enough_after(driver, back + SETTLE_S, after_answers):
        await asyncio.sleep(0.05)
    return {"store_back_s": round(back - t0, 2),
            "records_back_s": None if records is None else round(records - t0, 2),
            "services_back_s": None if listed is None else round(listed - t0, 2), "_back": back}


def _enough_after(driver: LoadDriver, settled: float, after_answers: int | None) -> bool:
    """Whether ``after_answers`` requests sent from ``settled`` on have their answers
    (None: the load runs its whole time)."""
    if after_answers is None:
        return False
    return sum(1 for a in driver.attempts if a.start_s >= settled and not a.open) >= after_answers


async def _one_fault(
    fault: Fault, node: ChaosNode, opts: ChaosOptions, session: aiohttp.ClientSession,
    driver: LoadDriver, rng: random.Random, t_start: float, known: set[int],
    kept: KeptState | None = None,
) -> dict[str, Any]:  # fmt: skip
    await asyncio.sleep(opts.slot_s * (0.25 + 0.25 * rng.random()))  # load before it
    if fault.cluster and opts.stream is not False:  # (hit a stream while it decodes)
        await _until_decoding(driver, DECODING_WAIT_S)
    pids_before = _pids(node)
    in_flight = driver.in_flight()
    probes = _Probes()
    probe_task = asyncio.create_task(probes.run(session, node.urls, driver.models[0]))
    t0 = time.time()
    done = await _inject(fault, node, opts)
    if fault.hold_s:
        await asyncio.sleep(fault.hold_s)
        await _end(fault, done)
    fault_end = time.time()
    if fault.cluster:
        done.update(await _store_back(node, session, t0, kept, driver, opts.after_answers))
    # let the load run to the middle of the slot, then until probes succeed for good (or
    # give up): a probe that fails late (a restarted service's first request) counts
    await asyncio.sleep(max(0.0, t0 + opts.slot_s * 0.5 - time.time()))
    limit = t0 + RECOVERY_LIMIT_S
    while time.time() < limit and not probes.serving_again(t0):
        await asyncio.sleep(PROBE_S)
    probe_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probe_task
    interrupted, recovery_s = probes.recovery(t0)
    driver.pause()
    await driver.drained(opts.request_timeout_s + HANG_MARGIN_S + 5.0)
    during = [a for a in driver.attempts if t0 <= a.start_s <= fault_end + (recovery_s or 0.0)]
    held = await _quiet(session, node)
    pids_after = _pids(node)
    restarted = sorted(n for n in pids_before if pids_after.get(n) != pids_before[n])
    cachemgr = str(pids_after.get("cachemgr", ""))
    # (many nodes: each node's cachemgr owns its segments, and no fault here touches them)
    segments = [] if node.cluster else shm_segments(node.run_dir)
    stale = [s for s in segments if _segment_owner(s) != cachemgr]
    known.update(pids_before.values())
    known.update(pids_after.values())
    strays = stray_processes(known, node.serve_pid, node.run_dir if node.cluster else None)
    missing = sorted(set(pids_before) - set(pids_after))
    row: dict[str, Any] = {
        "fault": fault.name,
        "at_s": round(t0 - t_start, 2),
        "hold_s": fault.hold_s,
        "in_flight": len(in_flight),
        "in_flight_outcomes": _outcomes(in_flight),
        "during_outcomes": _outcomes(during),
        "hung": sum(1 for a in [*in_flight, *during] if a.outcome in (None, "hung")),
        "interrupted": interrupted,
        "recovery_s": None if recovery_s is None else round(recovery_s, 2),
        "restarted": restarted,
        "unexpected_restarts": sorted(set(restarted) - set(fault.restarts)),
        "missing_services": missing,
        "holdings": held[0].to_dict() if len(held) == 1 else [h.to_dict() for h in held],
        "stale_shm_segments": stale,
        "stray_processes": strays,
        **{k: v for k, v in done.items() if not k.startswith("_")},
    }
    row["leaks"] = not all(h.quiet for h in held) or bool(stale) or bool(strays) or bool(missing)
    row["ok"] = (row["hung"] == 0 and recovery_s is not None and not row["leaks"]
                 and not row["unexpected_restarts"])  # fmt: skip
    if fault.cluster:
        row["answers"] = answers(driver.attempts, t0, done["_back"])
        row["settings_kept"] = await kept.check(session, node.urls) if kept else None
        after = row["answers"]["after"]
        decoding = row["answers"]["decoding_at_fault"]
        row["ok"] = row["ok"] and row["services_back_s"] is not None and after["sent"] > 0 and \
            after["num_other"] == 0 and row["answers"]["before"]["num_other"] == 0 and \
            decoding["completed"] == decoding["sent"] and \
            all((row["settings_kept"] or {}).values())  # fmt: skip
    driver.resume()
    return row


async def run_chaos(node: ChaosNode, opts: ChaosOptions) -> dict[str, Any]:
    """Run every fault of ``opts`` against ``node`` under load; the report."""
    rng = random.Random(opts.seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
    headers = auth_headers(opts.api_key)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        models = await list_models(session, node.base_url)
        baseline = await _quiet(session, node)
        kept = None
        if any(f.cluster for f in opts.faults):  # the run-time changes the store must keep
            kept = await KeptState.prepare(session, node.urls, models, opts.offered_models)
            models = kept.models(models) if kept is not None else models
        driver = LoadDriver(node.base_url, models, opts.concurrency, seed=opts.seed,
                            max_tokens=opts.max_tokens, timeout_s=opts.request_timeout_s,
                            more_urls=node.replica_urls, stream=opts.stream)  # fmt: skip
        load = asyncio.create_task(driver.run(session))
        t_start = time.time()
        rows: list[dict[str, Any]] = []
        known: set[int] = set()  # every service pid seen
        try:
            for fault in opts.faults:
                rows.append(await _one_fault(fault, node, opts, session, driver, rng, t_start,
                                             known, kept))
        finally:
            driver.stop()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(load, opts.request_timeout_s + HANG_MARGIN_S + 5.0)
        final = await _quiet(session, node)
    total = _outcomes(driver.attempts)
    return {
        "seed": opts.seed,
        "slot_s": opts.slot_s,
        "concurrency": opts.concurrency,
        "models": models,
        "nodes": node.nodes,
        "replicas": len(node.urls),
        "kept_state": None if kept is None else dataclasses.asdict(kept),
        "baseline_quiet": all(h.quiet for h in baseline),
        "faults": rows,
        "requests": {"sent": len(driver.attempts), **total},
        "final_holdings": [h.to_dict() for h in final] if node.cluster else final[0].to_dict(),
        "ok": all(r["ok"] for r in rows) and all(h.quiet for h in final) and total["hung"] == 0,
    }
