"""The process shell every instance shares: sockets, lease, heartbeat, compute thread.

An instance is an asyncio program whose loop only moves messages: commands
from the proxy go to the compute thread's inbox; messages the compute thread
produces go back to the proxy in order; a heartbeat reports stats. Torch runs
only on the compute thread (an :class:`InstanceLoop`).

Beside its sockets it serves ``/health``, ``/ready`` and ``/metrics`` on a
side port (``<kind>.http_host``/``http_port``): ready once registered with the
cachemgr, built, profiled (warm) and announced to the proxy; ``/health`` is a
503 once the compute thread stalled (``aegaeon_runtime.liveness``). SIGTERM drains
it: unready, the proxy is told (``InstanceDraining``) and stops giving it
work, the loop finishes what it holds (a decode instance its running
requests, a prefill instance its queue), the KV it handed off is claimed,
then it exits, all within ``drain_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import zmq.asyncio
from aegaeon_common.config import Config
from aegaeon_common.http_side import Readiness, SideServer
from aegaeon_common.logs import bind_process, get_logger
from aegaeon_common.messages.report import (
    CudaGraphStats,
    InstanceDraining,
    InstanceHello,
    InstanceStalled,
    InstanceStats,
)
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.metrics import new_registry
from aegaeon_common.process import cancel_tasks, mark_ready, ready_path
from aegaeon_common.registry import open_store
from aegaeon_common.store import Store
from aegaeon_common.transport import Puller, Pusher, RemoteError, release_security
from aegaeon_common.wire import Channel, Message, WireError

from aegaeon_runtime.bridge import ComputeThread, Inbox, Outbox
from aegaeon_runtime.cacheclient.client import CacheClient
from aegaeon_runtime.holdings import HoldingsBook
from aegaeon_runtime.incarnation import INCARNATION
from aegaeon_runtime.instance import InstanceLoop
from aegaeon_runtime.liveness import Progress, Verdict, judge
from aegaeon_runtime.metrics import InstanceCollector, InstanceLoad, WorkerMetrics
from aegaeon_runtime.registrar import Registrar
from aegaeon_runtime.worker import Worker, build_worker, instance_config

log = get_logger("instance")

HEARTBEAT_S = 0.5
# the heartbeat judges liveness every HEARTBEAT_S: a longer gap means the whole process
# was paused, and the compute thread's silence over it is not its own
PAUSE_GAP_S = 5.0
POLL_S = 0.05
REPLICAS_POLL_S = 0.25  # a draining instance of many nodes asks the store this often
NOTICE_S = 1.0  # how long the drain notice may wait to be queued for the proxy
T = TypeVar("T")


LoopFactory = Callable[[Worker, Inbox[Message], Outbox], InstanceLoop]


def _hello(worker: Worker, instance: InstanceLoop) -> InstanceHello:
    inst = instance_config(worker.config, worker.kind)
    capacity = worker.capacity_tokens()
    latency = (msgspec.convert(instance.latency.to_dict(), LatencyProfile)
               if instance.latency else None)  # fmt: skip
    return InstanceHello(
        incarnation=INCARNATION,
        kind=worker.kind,
        index=worker.index,
        pid=os.getpid(),
        kv_capacity_bytes=inst.kv_memory_bytes,
        weights_capacity_bytes=worker.buffer.weights_capacity,
        max_batch_size=worker.config.scheduler.max_batch_size,
        capacity_tokens=capacity,
        latency=latency,
    )


def _models_changed(hello: InstanceHello, worker: Worker) -> bool:
    """``hello`` lists other models than the worker serves now, or a latency profile
    that lacks one (the compute thread adds a model's spec to the worker first, to
    the latency model next: the next beat sees both)."""
    served = set(worker.specs)
    if set(hello.capacity_tokens) != served:
        return True
    return hello.latency is not None and set(hello.latency.models) != served


def with_holdings(stats: InstanceStats, worker: Worker, book: HoldingsBook) -> InstanceStats:
    """``stats`` plus what the instance holds now, for the proxy's leak checks
    (``/v1/aegaeon/stats``): ``holdings`` (versioned, see ``aegaeon_runtime.holdings``)
    and, in the counters, its ``kv_blocks_in_use`` (device KV blocks allocated or
    waiting on the move list) and ``open_sequences`` (requests queued for prefill
    or in the decode work list, as the compute thread last published them); and
    for its KV usage (``vllm:kv_cache_usage_perc``): ``kv_used_bytes`` (live
    blocks) of ``kv_capacity_bytes`` (the region's whole slabs); and ``cuda_graphs``,
    what its decode-step graphs did (captures, replays, steps run eager and why)."""
    held = book.read()
    slabs = worker.kv.pool.stats().slabs
    counters = {
        **stats.counters,
        "kv_blocks_in_use": float(held.kv_blocks_in_use),
        "open_sequences": float(held.open_sequences),
        "kv_used_bytes": float(slabs.used_bytes),
        "kv_capacity_bytes": float(slabs.num_slabs * slabs.slab_bytes),
    }
    # token velocity by stage, as /metrics exports it (the proxy sums the cluster's)
    velocity = worker.metrics.velocity()
    # the version first: read with the names after it, it is never newer than they are
    version = worker.switcher.residency_version + worker.adapters.version
    resident = worker.adapters.with_adapters(worker.switcher.resident_models())
    graphs = msgspec.convert(worker.engine.graph_stats.to_dict(), CudaGraphStats)
    return msgspec.structs.replace(stats, counters=counters, velocity=velocity,
                                   resident_models=resident,
                                   residency_version=version, holdings=held,
                                   cuda_graphs=graphs)  # fmt: skip


class _Live:
    """What a scrape may read of an instance that is still starting."""

    def __init__(self, stall_s: float) -> None:
        self.worker: Worker | None = None
        self.instance: InstanceLoop | None = None
        self.inbox: Inbox[Message] | None = None
        self.compute: ComputeThread | None = None
        self.stall_s = stall_s
        self.stalled: Verdict | None = None  # final once set (aegaeon_runtime.liveness)
        # when the event loop last judged, and since when it runs again after a pause of
        # the whole process (SIGSTOP, a suspended VM): that pause is no compute stall
        self._judged_s = time.monotonic()
        self._resumed_s = 0.0

    def load(self) -> InstanceLoad:
        return self.instance.load if self.instance is not None else InstanceLoad()

    def verdict(self) -> Verdict:
        """The compute thread's liveness now (the first stall stays the verdict)."""
        if self.stalled is not None:
            return self.stalled
        instance, inbox, compute, worker = self.instance, self.inbox, self.compute, self.worker
        if instance is None or inbox is None or compute is None or worker is None:
            return judge(Progress(0.0, None, 0, 0, False), 0.0, self.stall_s)
        load = instance.load
        now = time.monotonic()
        if now - self._judged_s > PAUSE_GAP_S:
            self._resumed_s = now
        self._judged_s = now
        progress = Progress(
            taken_s=max(inbox.taken_s, self._resumed_s),
            calling_since_s=worker.cache.calling_since(compute.ident),
            queued=load.prefill_requests + load.decode_requests,
            commands=inbox.pending(),
            started=instance.ready.is_set() and compute.is_alive(),
        )
        verdict = judge(progress, now, self.stall_s)
        if verdict.stalled:
            self.stalled = verdict
        return verdict


async def _until_stop(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None if ``stop`` is set first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def serve_instance(
    config: Config,
    kind: str,
    index: int,
    channel: Channel,
    make_loop: LoopFactory,
    stop: asyncio.Event,
) -> None:
    """Run one instance until ``stop`` (SIGTERM: drain first); raises if the compute
    thread crashes."""
    name = f"{kind}-{index}"
    bind_process(instance=name)  # every line of this process names its instance
    inst = instance_config(config, kind)
    registry = new_registry()
    metrics = WorkerMetrics(name, registry)
    live = _Live(config.health.stall_s)
    registry.register(InstanceCollector(metrics, lambda: live.worker, live.load))
    readiness = Readiness()

    def health() -> dict[str, Any]:
        worker = live.worker
        active = worker.switcher.active_model if worker is not None else None
        verdict = live.verdict()
        tid = live.compute.native_id if live.compute is not None else None
        body: dict[str, Any] = {"instance": name, "active_model": active,
                                "compute_thread": verdict.body(live.stall_s, tid)}  # fmt: skip
        if verdict.stalled:
            body.update(status="stalled", reason=verdict.reason)
        return body

    side = SideServer(
        name, kind, registry, readiness, host=inst.http_host, port=inst.http_port_of(index),
        run_dir=config.run_dir, health=health,
    )  # fmt: skip
    await side.start()
    log.info("http", instance=name, url=side.url)
    # Many nodes: the registry in the shared store replaces hellos and heartbeats to
    # one proxy; a store that cannot be reached at start is fatal (exit, restart).
    store = open_store(config) if config.distributed else None
    try:
        if store is not None:
            await store.start()
        await _serve(config, kind, index, channel, make_loop, stop, metrics, live, readiness,
                     store, side.url or "")  # fmt: skip
    finally:
        if store is not None:
            await store.close()
        await side.stop()


async def _serve(
    config: Config,
    kind: str,
    index: int,
    channel: Channel,
    make_loop: LoopFactory,
    stop: asyncio.Event,
    metrics: WorkerMetrics,
    live: _Live,
    readiness: Readiness,
    store: Store | None = None,
    http_url: str = "",
) -> None:
    name = f"{kind}-{index}"
    ctx = zmq.asyncio.Context()
    client = CacheClient(config.cachemgr_address, name, ctx)
    readiness.set_reason("registering with the cachemgr and building the worker")
    worker = await _until_stop(build_worker(config, kind, index, client, metrics), stop)
    if worker is None:  # stopped while starting
        await client.close(unregister=False)
        release_security(ctx)
        ctx.term()
        return
    live.worker = worker
    loop = asyncio.get_running_loop()
    commands = Puller(ctx, config.instance_bind_address(kind, index), channel, bind=True)
    to_proxy = Pusher(ctx, config.proxy_address)
    inbox: Inbox[Message] = Inbox()
    # many proxies: every message follows its request's reply_to (no default proxy)
    outbox = Outbox(None if store is not None else config.proxy_address)
    registrar: Registrar | None = None
    instance = make_loop(worker, inbox, outbox)
    live.instance, live.inbox = instance, inbox
    crashed: list[BaseException] = []
    closing = False

    def on_crash(exc: BaseException) -> None:
        crashed.append(exc)
        stop.set()

    compute = ComputeThread(f"aegaeon-{name}", instance.run, loop, on_crash)
    live.compute = compute
    compute.start()
    readiness.set_reason("warming up (start-up profile)")
    tasks: list[asyncio.Task[None]] = []
    try:
        while not instance.ready.is_set():  # the start-up profile (needs this loop running)
            await asyncio.sleep(POLL_S)
            if crashed:
                raise RuntimeError(f"{name}: compute thread crashed") from crashed[0]
            if stop.is_set():
                return
        hello = _hello(worker, instance)
        if store is not None:
            registrar = Registrar(config, store, hello, http_url, instance.snapshots)

        async def receive() -> None:
            while True:
                try:
                    msg = await commands.recv()
                except WireError as exc:  # nobody to answer on PULL: count and go on
                    metrics.bad_frame(exc.code)
                    log.warning("bad command frame", instance=name, error=str(exc))
                    continue
                meant = getattr(msg, "incarnation", 0)
                if meant and meant != hello.incarnation:
                    # queued for the process this one replaced; the proxy has failed
                    # or re-dispatched that work since, so doing it now would do it twice
                    metrics.bad_frame("stale")
                    log.info("stale_command_dropped", instance=name, tag=msg.TAG)
                    continue
                reply_to = getattr(msg, "reply_to", "")
                request_id = getattr(msg, "request_id", None)
                if reply_to and isinstance(request_id, str):
                    # the proxy replica that holds this request's client (an answer to
                    # AddModel or SetModelAwake names its reply_to itself)
                    outbox.route(request_id, reply_to)
                inbox.put(msg)

        async def heartbeat() -> None:
            nonlocal hello
            while not closing:
                verdict = live.verdict()
                if verdict.stalled:  # said once; no hello from this process again
                    await _stalled(name, kind, index, verdict, to_proxy, registrar, readiness)
                    return
                if _models_changed(hello, worker):  # a model was added
                    hello = msgspec.structs.replace(hello, capacity_tokens=worker.capacity_tokens(),
                                                    latency=_hello(worker, instance).latency)
                    if registrar is not None:
                        registrar.serve(hello)
                stats = with_holdings(instance.stats(), worker, instance.holdings)
                if registrar is not None:
                    await registrar.beat(stats)
                else:
                    await to_proxy.send(hello)  # cheap; lets a restarted proxy learn us again
                    await to_proxy.send(stats)
                readiness.set_ready()  # announced: the proxy can place work here
                await asyncio.sleep(HEARTBEAT_S)

        tasks = [loop.create_task(t) for t in (receive(), heartbeat())]
        mark_ready(config.run_dir, name)
        log.info("ready", instance=name, models=len(worker.specs))
        await stop.wait()
        if not crashed:
            if registrar is not None:  # no new work from any replica; still beating
                registrar.draining = True
                await registrar.beat(instance.stats())
            await _drain(config, kind, index, name, instance, compute, to_proxy, worker, readiness,
                         registrar)  # fmt: skip
    finally:
        closing = True  # the heartbeat stops beating even if its cancellation is lost
        stuck = await cancel_tasks(tasks)
        if stuck:
            log.warning("tasks_not_cancelled", instance=name, tasks=stuck)
        if registrar is not None:  # after the heartbeat: it would register us again
            await registrar.deregister()
        compute.join()
        outbox.close()
        worker.close()
        await client.close()
        commands.close()
        to_proxy.close()
        release_security(ctx)
        ctx.destroy(linger=0)  # and any socket left open: term() would wait for it for good
        ready_path(config.run_dir, name).unlink(missing_ok=True)
    if crashed:
        raise RuntimeError(f"{name}: compute thread crashed") from crashed[0]


async def _stalled(name: str, kind: str, index: int, verdict: Verdict, to_proxy: Pusher,
                   registrar: Registrar | None, readiness: Readiness) -> None:
    """Say the stall once (``aegaeon_runtime.liveness``): the proxy marks the instance
    down and fails its requests over; with many proxies the registry forgets it."""
    log.error("compute_thread_stalled", instance=name, since_progress_s=verdict.since_progress_s,
              reason=verdict.reason)  # fmt: skip
    readiness.set_failed(f"stalled: {verdict.reason}")
    if registrar is not None:
        await registrar.deregister()
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(to_proxy.send(InstanceStalled(
            kind, index, os.getpid(), verdict.since_progress_s, verdict.reason)), NOTICE_S)


async def _drain(
    config: Config,
    kind: str,
    index: int,
    name: str,
    instance: InstanceLoop,
    compute: ComputeThread,
    to_proxy: Pusher,
    worker: Worker,
    readiness: Readiness,
    registrar: Registrar | None = None,
) -> None:
    """Finish what the instance holds (see the module docstring), within the drain timeout.
    One node: the proxy is told (it answers ``AckDrain``); many (``registrar``): the
    registry record says it, and no replica answers; once none is listed (the cluster
    stops, its replicas first) nothing more can come and the loop need not wait out
    ``aegaeon_runtime.drain.ACK_WAIT_S`` for an answer."""
    timeout_s = config.drain_timeout_s
    deadline = time.monotonic() + timeout_s
    readiness.set_draining()
    instance.drain.request()
    with contextlib.suppress(TimeoutError):  # a proxy gone for long: its queue may be full
        if registrar is None:
            await asyncio.wait_for(
                to_proxy.send(InstanceDraining(kind, index, os.getpid(), timeout_s)), NOTICE_S
            )
    load = instance.load
    log.info(
        "draining", instance=name, timeout_s=timeout_s,
        prefill_requests=load.prefill_requests, decode_requests=load.decode_requests,
    )  # fmt: skip
    asked_s = 0.0
    while compute.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        if registrar is not None and not instance.drain.acked and \
                time.monotonic() - asked_s >= REPLICAS_POLL_S:  # fmt: skip
            asked_s = time.monotonic()
            if await registrar.no_replica():
                instance.drain.acked = True  # (read by the compute thread: one flag)
    # Host KV blocks this instance still owns are handoffs no decode instance has
    # claimed yet: ending the lease now would free them under their requests.
    held = await _owned_blocks(worker, name)
    while held and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        held = await _owned_blocks(worker, name)
    if compute.is_alive() or held:
        log.warning("drain_timeout", instance=name, still_running=compute.is_alive(),
                    unclaimed_blocks=held)  # fmt: skip
    else:
        log.info("drained", instance=name)


async def _owned_blocks(worker: Worker, name: str) -> int:
    try:
        stats = await worker.client.stats()
    except (RemoteError, TimeoutError):
        return 0  # no cachemgr: nothing to protect
    return int(stats.kv.blocks_per_owner.get(name, 0))
