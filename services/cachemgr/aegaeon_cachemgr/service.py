"""The cachemgr process: start, serve, watch workers, prewarm, and leave nothing behind.

Start: take the run directory's lock (one cachemgr per run), unlink stale
segments of a crashed earlier run (they carry this run's ``shm_prefix``),
create the KV region and the event table, bind the ROUTER, mark ready.
Stop (SIGTERM/SIGINT, or a fatal error): unlink every segment it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq.asyncio
from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import REQUESTS
from aegaeon_common.process import mark_ready, ready_path
from aegaeon_common.transport import RpcServer
from aegaeon_gpumem import cleanup_prefix

from aegaeon_cachemgr.errors import CacheError
from aegaeon_cachemgr.manager import CacheManager

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
    run_dir.mkdir(parents=True, exist_ok=True)
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


async def prewarm(manager: CacheManager, names: list[str]) -> None:
    """Load the prewarm list one model at a time, never evicting (so order = priority)."""
    for name in names:
        try:
            await manager.models.acquire(name, "", pin=False, evict=False)
        except CacheError as exc:
            log.warning("prewarm_skipped", model=name, code=exc.code, error=exc.message)


async def monitor(manager: CacheManager) -> None:
    """Reclaim the leases of dead workers every ``MONITOR_INTERVAL_S``."""
    while True:
        await asyncio.sleep(MONITOR_INTERVAL_S)
        manager.reap_dead()


async def serve(config: Config, stop: asyncio.Event) -> None:
    """Run the cachemgr until ``stop`` is set."""
    with run_lock(config.run_dir):
        removed = cleanup_prefix(f"{config.shm_prefix}-")
        if removed:
            log.warning("stale_segments_removed", segments=removed)
        executor = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="cachemgr-load")
        try:
            manager = CacheManager(config, executor)
            try:
                await _serve(config, manager, stop)
            finally:
                manager.close()
                ready_path(config.run_dir, SERVICE).unlink(missing_ok=True)
                log.info("stopped")
        finally:
            # A load still on its thread finishes into unlinked pages; don't wait for it.
            executor.shutdown(wait=False, cancel_futures=True)


async def _serve(config: Config, manager: CacheManager, stop: asyncio.Event) -> None:
    ctx = zmq.asyncio.Context()
    server = RpcServer(ctx, config.cachemgr_address, REQUESTS, manager.handle)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = [
        loop.create_task(server.serve_forever(), name="rpc"),
        loop.create_task(monitor(manager), name="monitor"),
        loop.create_task(prewarm(manager, prewarm_names(config)), name="prewarm"),
    ]
    stopping: asyncio.Task[bool] = loop.create_task(stop.wait(), name="stop")
    try:
        mark_ready(config.run_dir, SERVICE)
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
    finally:
        stopping.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(stopping, *tasks, return_exceptions=True)
        server.close()
        ctx.term()
