"""The cachemgr process: start, serve, watch workers, prewarm, and leave nothing behind.

Start: serve ``/health``, ``/ready`` (503 until ready) and ``/metrics`` on the
side port (``cachemgr.http_host``/``http_port``), take the run directory's
lock (one cachemgr per run), unlink stale segments of a crashed earlier run
(they carry this run's ``shm_prefix``), create the KV region and the event
table, bind the ROUTER, mark ready.
Stop (SIGTERM/SIGINT): unready, keep answering the workers until none holds a
lease (they drain and unregister first) or ``drain_timeout`` passes, then
unlink every segment it made. A fatal error unlinks them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq.asyncio
from aegaeon_common.config import Config
from aegaeon_common.http_side import Readiness, SideServer
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import REQUESTS
from aegaeon_common.metrics import new_registry
from aegaeon_common.process import mark_ready, private_dir, ready_path
from aegaeon_common.transport import RpcServer, release_security
from aegaeon_gpumem import cleanup_prefix
from prometheus_client import CollectorRegistry

from aegaeon_cachemgr.errors import CacheError
from aegaeon_cachemgr.manager import CacheManager
from aegaeon_cachemgr.metrics import CacheCollector, request_counter
from aegaeon_cachemgr.model_cache import OPERATOR

log = get_logger("cachemgr")

SERVICE = "cachemgr"
MONITOR_INTERVAL_S = 0.5
LOAD_THREADS = 2  # the machine has 2 cores; loads are mostly memcpy and disk reads


class AlreadyRunning(RuntimeError):  # noqa: N818 (reads as the condition)
    """Another cachemgr holds this run directory."""


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive lock on ``run_dir/cachemgr.lock`` for the process's lifetime.

    Without it a second cachemgr on the same run would unlink the first one's
    segments as "stale" at start.
    """
    private_dir(run_dir)
    fd = os.open(run_dir / f"{SERVICE}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AlreadyRunning(f"another cachemgr serves {run_dir}") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def prewarm_names(config: Config) -> list[str]:
    wanted = config.cache.prewarm
    if "*" in wanted:
        return list(config.model_names)
    unknown = [n for n in wanted if config.model(n) is None]
    if unknown:
        log.warning("prewarm_unknown_models", models=unknown)
    return [n for n in wanted if config.model(n) is not None]


def start_loads(config: Config) -> list[tuple[str, bool]]:
    """What the Model Cache loads at start, in order, and whether the operator pins it:
    the models ``model_settings`` pins, those it preloads, then the prewarm list."""
    names = config.model_names
    pinned = [n for n in names if config.settings_of(n).pin]
    preload = [n for n in names if config.settings_of(n).preload and n not in pinned]
    rest = [n for n in prewarm_names(config) if n not in pinned and n not in preload]
    return [(n, True) for n in pinned] + [(n, False) for n in preload + rest]


async def prewarm(manager: CacheManager, loads: list[tuple[str, bool]]) -> None:
    """Load one model at a time, never evicting (so order = priority); pin those the
    operator pins."""
    for name, pin in loads:
        try:
            await manager.models.acquire(name, OPERATOR if pin else "", pin=pin, evict=False)
        except CacheError as exc:
            log.warning("prewarm_skipped", model=name, code=exc.code, error=exc.message)


async def monitor(manager: CacheManager) -> None:
    """Reclaim the leases of dead workers every ``MONITOR_INTERVAL_S``."""
    while True:
        await asyncio.sleep(MONITOR_INTERVAL_S)
        manager.reap_dead()


async def serve(config: Config, stop: asyncio.Event) -> None:
    """Run the cachemgr until ``stop`` is set (then drain)."""
    registry = new_registry()
    readiness = Readiness()
    side = SideServer(
        SERVICE, SERVICE, registry, readiness, host=config.cache.http_host,
        port=config.cache.http_port, run_dir=config.run_dir,
    )  # fmt: skip
    await side.start()
    log.info("http", url=side.url)
    try:
        await _serve_locked(config, stop, registry, readiness)
    finally:
        await side.stop()


async def _serve_locked(
    config: Config, stop: asyncio.Event, registry: CollectorRegistry, readiness: Readiness
) -> None:
    with run_lock(config.run_dir):
        removed = cleanup_prefix(f"{config.shm_prefix}-")
        if removed:
            log.warning("stale_segments_removed", segments=removed)
        executor = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="cachemgr-load")
        try:
            manager = CacheManager(config, executor, request_counter(registry))
            collector = CacheCollector(manager)
            registry.register(collector)
            try:
                await manager.check_models()  # an unreadable checkpoint: quarantined, not fatal
                await _serve(config, manager, stop, readiness)
            finally:
                registry.unregister(collector)  # a scrape must not read closed segments
                manager.close()
                ready_path(config.run_dir, SERVICE).unlink(missing_ok=True)
                log.info("stopped")
        finally:
            # A load still on its thread finishes into unlinked pages; don't wait for it.
            executor.shutdown(wait=False, cancel_futures=True)


async def _drain(manager: CacheManager, timeout_s: float) -> None:
    """Answer the workers until none holds a lease (or ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    leases = manager.workers.leases()
    log.info("draining", workers=[lease.worker_id for lease in leases], timeout_s=timeout_s)
    while manager.workers.leases() and time.monotonic() < deadline:
        await asyncio.sleep(MONITOR_INTERVAL_S / 5)
    left = [lease.worker_id for lease in manager.workers.leases()]
    if left:
        log.warning("drain_timeout", workers=left)


async def _serve(
    config: Config, manager: CacheManager, stop: asyncio.Event, readiness: Readiness
) -> None:
    ctx = zmq.asyncio.Context()
    server = RpcServer(ctx, config.cachemgr_address, REQUESTS, manager.handle)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = [
        loop.create_task(server.serve_forever(), name="rpc"),
        loop.create_task(monitor(manager), name="monitor"),
        loop.create_task(prewarm(manager, start_loads(config)), name="prewarm"),
    ]
    stopping: asyncio.Task[bool] = loop.create_task(stop.wait(), name="stop")
    try:
        mark_ready(config.run_dir, SERVICE)
        readiness.set_ready()
        log.info(
            "ready",
            address=config.cachemgr_address,
            kv_region=manager.kv_region.name,
            kv_cache_bytes=manager.kv_region.nbytes,
            event_table=manager.events.name,
            model_cache_bytes=config.cache.model_cache_bytes,
            models=len(config.models),
        )
        # The rpc and monitor tasks never end; if one does, it failed: raise it.
        await asyncio.wait([stopping, *tasks[:2]], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks[:2]:
            if task.done():
                task.result()
        readiness.set_draining()
        drain = loop.create_task(_drain(manager, config.drain_timeout_s), name="drain")
        await asyncio.wait([drain, *tasks[:2]], return_when=asyncio.FIRST_COMPLETED)
        drain.cancel()
        for task in tasks[:2]:
            if task.done():
                task.result()
    finally:
        stopping.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(stopping, *tasks, return_exceptions=True)
        server.close()
        release_security(ctx)
        ctx.term()
