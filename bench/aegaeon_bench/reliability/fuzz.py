"""``aegaeon bench fuzz``: hypothesis-generated bad input against a live node.

Starts ``aegaeon serve`` and sends ``--examples`` requests drawn by
:mod:`aegaeon_bench.reliability.fuzz_inputs` to its two endpoints (half each), checking every
answer: never a 5xx, errors in OpenAI's shape, 429s with ``Retry-After``,
well-formed bodies and streams. Then ``--frames`` frames to each of its ZeroMQ
sockets (the cachemgr's ROUTER, each instance's and the proxy's PULL): the
ROUTER must answer every one with a typed reply, a PULL must count each frame
its channel refuses (``aegaeon_bad_frames_total`` / the proxy's
``bad_frames``); frames past the size limit are dropped unread. Afterwards every
service must still run, with the same pid, and be ready. Last, ``--slow-clients``
readers that never read a long stream and as many writers sending their body a
byte a second (:mod:`aegaeon_bench.reliability.slow_clients`): the proxy's memory, and when
it cut them. Needs hypothesis (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from aegaeon_bench import common


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "fuzz",
        "hypothesis bad input on both endpoints and every ZeroMQ socket: 0 5xx", __doc__)
    parser.add_argument("--examples", type=int, default=2000, help="HTTP requests (2000)")
    parser.add_argument("--frames", type=int, default=500, help="frames per socket (500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-clients", type=int, default=20,
                        help="never-reading readers and byte-a-second writers, each (20)")
    parser.add_argument("--slow-max-tokens", type=int, default=8000,
                        help="the length a never-reading reader asks for (8000)")
    parser.add_argument("--slow-limit", type=float, default=300.0,
                        help="s a slow client waits to be cut (300): a reader is cut "
                        "write_timeout after its buffers filled, which takes a while")
    common.add_own_node_arguments(parser)
    parser.set_defaults(func=run)


def fuzz_http(base_url: str, models: list[str], examples: int, seed: int,
              headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """``examples`` hypothesis cases against the endpoints (``headers``: an API key, sent
    with each); statuses and problems."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from aegaeon_bench.reliability.fuzz_inputs import HttpCase, check_http, http_cases

    statuses: Counter[int] = Counter()
    problems: list[str] = []
    with asyncio.Runner() as runner:
        session = runner.run(_session(headers))

        async def one(case: HttpCase) -> None:
            try:
                async with session.post(base_url + case.endpoint, data=case.body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    body = await resp.read()
                    statuses[resp.status] += 1
                    found = check_http(case, resp.status, dict(resp.headers), body)
            except (aiohttp.ClientError, TimeoutError) as exc:
                statuses[0] += 1
                found = [f"no answer: {type(exc).__name__}: {exc}"]
            problems.extend(f"{case.endpoint} {case.body[:200]!r}: {p}" for p in found)

        @hseed(seed)
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(http_cases(models))
        def check(case: HttpCase) -> None:
            runner.run(one(case))

        check()
        runner.run(session.close())
    return {"examples": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "5xx": sum(n for s, n in statuses.items() if s >= 500),
            "problems": problems[:20], "num_problems": len(problems)}  # fmt: skip


async def _session(headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), headers=headers)


def _frames(count: int, seed: int, valid: list[bytes]) -> list[bytes]:
    from aegaeon_common.transport import MAX_FRAME_BYTES
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from aegaeon_bench.reliability.fuzz_inputs import zmq_frames

    out: list[bytes] = []

    @hseed(seed)
    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(zmq_frames(valid, MAX_FRAME_BYTES))
    def collect(frame: bytes) -> None:
        out.append(frame)

    collect()
    return out


def _valid_frames() -> list[bytes]:
    from aegaeon_common.messages.cache import GetStats
    from aegaeon_common.messages.prefill import CancelRequest
    from aegaeon_common.messages.report import InstanceStats
    from aegaeon_common.wire import encode

    return [encode(CancelRequest("fuzz-unknown")), encode(GetStats()),
            encode(InstanceStats("decode", 99, None, 0, 0))]  # fmt: skip


async def _router(address: str, frames: list[bytes], limit: int) -> dict[str, Any]:
    """Each frame to the cachemgr's ROUTER; every one but the oversized is answered."""
    import msgspec
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    answered: Counter[str] = Counter()
    missing = 0
    for i, frame in enumerate(frames):
        rid = struct.pack("<Q", i + 1)
        await sock.send_multipart([rid, frame])
        if len(frame) > limit:
            continue  # dropped unread with the connection; the next frame reconnects
        try:
            while True:
                got_rid, reply = await asyncio.wait_for(sock.recv_multipart(), 10.0)
                if got_rid == rid:
                    break
            tag = msgspec.msgpack.decode(reply).get("t")
            code = msgspec.msgpack.decode(reply).get("code") if tag == "error" else None
            answered[f"{tag}:{code}" if code else str(tag)] += 1
        except TimeoutError:
            missing += 1
    sock.close(0)
    ctx.term()
    return {"frames": len(frames), "answered": dict(answered), "unanswered": missing,
            "oversized": sum(len(f) > limit for f in frames)}  # fmt: skip


async def _push(address: str, frames: list[bytes]) -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for frame in frames:
        await sock.send(frame)
        await asyncio.sleep(0.002)
    await asyncio.sleep(1.0)
    sock.close(2000)
    ctx.term()


def _refused(channel: Any, frames: list[bytes], limit: int) -> int:
    """How many of ``frames`` ``channel`` refuses (the oversized never arrive)."""
    from aegaeon_common.wire import WireError

    count = 0
    for frame in frames:
        if len(frame) > limit:
            continue
        try:
            channel.decode(frame)
        except WireError:
            count += 1
    return count


async def _bad_frames_metric(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "aegaeon_bad_frames_total"
               and s.labels.get("code") != "stale")  # fmt: skip


async def _proxy_bad_frames(base_url: str, headers: dict[str, str] | None) -> int:
    async with aiohttp.ClientSession(headers=headers) as session, \
            session.get(f"{base_url}/v1/aegaeon/stats?light=1") as resp:  # fmt: skip
        return int((await resp.json())["counters"].get("bad_frames", 0))


async def fuzz_zmq(base_url: str, run_dir: Path, frames: int, seed: int, *,
                   headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """``frames`` frames to every socket of the node; ``base_url``: where its admin
    endpoints are (``/v1/aegaeon/services``, ``/v1/aegaeon/stats``); ``headers``: sent
    to them (an admin key, where the node has keys)."""
    from aegaeon_common.messages.cache import REQUESTS
    from aegaeon_common.messages.decode import DECODE_CHANNEL, HYBRID_CHANNEL
    from aegaeon_common.messages.report import REPORT_CHANNEL
    from aegaeon_common.transport import MAX_FRAME_BYTES

    batch = _frames(frames, seed, _valid_frames())
    out: dict[str, Any] = {"cachemgr": await _router(f"ipc://{run_dir}/cachemgr.sock", batch,
                                                     MAX_FRAME_BYTES)}  # fmt: skip
    out["cachemgr"]["refused_by_channel"] = _refused(REQUESTS, batch, MAX_FRAME_BYTES)
    async with aiohttp.ClientSession(headers=headers) as session, \
            session.get(f"{base_url}/v1/aegaeon/services") as resp:  # fmt: skip
        services = {s["name"]: s for s in (await resp.json())["services"]}
    for name, channel in (("prefill-0", HYBRID_CHANNEL), ("decode-0", DECODE_CHANNEL)):
        metrics_url = services[name]["metrics_url"]
        before = await _bad_frames_metric(metrics_url)
        await _push(f"ipc://{run_dir}/{name}.sock", batch)
        want = _refused(channel, batch, MAX_FRAME_BYTES)
        deadline = time.monotonic() + 10.0
        counted = await _bad_frames_metric(metrics_url) - before
        while counted < want and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            counted = await _bad_frames_metric(metrics_url) - before
        out[name] = {"frames": len(batch), "refused_by_channel": want, "counted": int(counted)}
    before_p = await _proxy_bad_frames(base_url, headers)
    await _push(f"ipc://{run_dir}/proxy.sock", batch)
    want = _refused(REPORT_CHANNEL, batch, MAX_FRAME_BYTES)
    await asyncio.sleep(1.0)
    out["proxy"] = {"frames": len(batch), "refused_by_channel": want,
                    "counted": await _proxy_bad_frames(base_url, headers) - before_p}  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.process import run_fast

    from aegaeon_bench.node.client import auth_headers, served_models
    from aegaeon_bench.node.http_client import fetch_sync
    from aegaeon_bench.node.launch import start_bench_node
    from aegaeon_bench.node.probe import serve_children

    key = common.api_key(args)
    headers = auth_headers(key)

    node = start_bench_node("fuzz", common.node_market(args), args.config)
    if node is None:
        return 1
    try:
        assert node.run_dir is not None
        models = served_models(node.url, key)
        pids = {n: p.pid for n, p in serve_children(node.proc.pid).items()}
        start = time.monotonic()
        http = fuzz_http(node.url, [*models, "no-such-model"], args.examples, args.seed,
                         headers)
        http["seconds"] = round(time.monotonic() - start, 1)
        zmq_report = run_fast(fuzz_zmq(node.url, node.run_dir, args.frames, args.seed,
                                       headers=headers))
        slow = None
        if args.slow_clients:
            from aegaeon_bench.reliability.slow_clients import slow_clients

            slow = run_fast(slow_clients(node.url, node.proc.pid, models[0], args.slow_clients,
                                         args.slow_max_tokens, args.slow_limit,
                                         api_key=key))  # fmt: skip
        after = {n: p.pid for n, p in serve_children(node.proc.pid).items()}
        ready = fetch_sync("GET", f"{node.url}/ready").status == 200
    finally:
        node.stop()
    zmq_ok = (zmq_report["cachemgr"]["unanswered"] == 0
              and all(zmq_report[n]["counted"] == zmq_report[n]["refused_by_channel"]
                      for n in ("prefill-0", "decode-0", "proxy")))  # fmt: skip
    slow_ok = slow is None or (slow["readers_cut"] == slow["writers_cut"] == slow["count"])
    report = {**common.machine_info(), "seed": args.seed, "http": http, "zmq": zmq_report,
              "slow_clients": slow,
              "pids_unchanged": pids == after, "ready_after": ready,
              "ok": http["5xx"] == 0 and http["num_problems"] == 0 and zmq_ok and slow_ok
              and pids == after and ready}  # fmt: skip
    print(f"HTTP: {http['examples']} requests in {http['seconds']} s, statuses "
          f"{http['statuses']}, 5xx {http['5xx']}, problems {http['num_problems']}")
    for name in ("cachemgr", "prefill-0", "decode-0", "proxy"):
        print(f"ZeroMQ {name}: {zmq_report[name]}")
    if slow is not None:
        print(f"slow clients: {slow}")
    print(f"services unchanged {pids == after}, ready {ready}; "
          f"{'OK' if report['ok'] else 'FAILED'}")
    return common.emit_report(args, report)
