"""A worker over a real cachemgr in one process (the switch bench's and the switcher
tests' setup): a cachemgr process and one worker built from a Config.

:func:`switch_rig` starts ``aegaeon cachemgr --config FILE`` in a temporary run
directory, waits until every model is resident in the Model Cache (prewarm
``*``: the scale-ups measured are from a warm cache), and builds a decode
worker with :func:`aegaeon_runtime.worker.build_worker`, its event loop on a
thread, so the calling thread plays the compute thread exactly as in an
instance. On exit the worker and the cachemgr are stopped, no segment of the
run is left in /dev/shm, and the run directory is removed.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aegaeon_common.config import CacheConfig, Config, load_config
from aegaeon_common.process import is_ready
from aegaeon_gpumem import cleanup_prefix
from aegaeon_runtime.worker import Worker

from aegaeon_bench.node.launch import aegaeon_argv, interrupt

T = TypeVar("T")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0  # a busy machine may take a while to close the client
WORKER_ID = "switch-bench"


@dataclass(frozen=True)
class RigSizes:
    """Memory of the rig (bytes): Model Cache, host KV cache, slabs, the worker's buffer."""

    model_cache_bytes: int
    kv_cache_bytes: int
    slab_bytes: int
    device_memory_bytes: int
    kv_memory_bytes: int


def rig_sizes(model_bytes: Sequence[int], kv_bytes: int) -> RigSizes:
    """Sizes for models of ``model_bytes`` and decode batches of ``kv_bytes`` of KV.

    The Model Cache holds every model; the host KV cache and its slabs are the
    deployment defaults (``CacheConfig``), or larger if two batches need it.
    The worker's arena holds the largest model twice (active + prefetched)
    plus slack; its device KV region holds two batches plus slack.
    """
    mib = 1 << 20
    defaults = CacheConfig()
    kv_region = -(-(2 * kv_bytes + 32 * mib) // (4 * mib)) * 4 * mib
    arena = -(-(2 * max(model_bytes) + 16 * mib) // mib) * mib
    return RigSizes(model_cache_bytes=sum(model_bytes) + 64 * mib,
                    kv_cache_bytes=max(kv_region, defaults.kv_cache_bytes),
                    slab_bytes=defaults.slab_bytes, device_memory_bytes=arena + kv_region,
                    kv_memory_bytes=kv_region)  # fmt: skip


@dataclass
class Rig:
    """A running cachemgr and a worker attached to it (see the module docstring)."""

    config: Config
    worker: Worker
    loop: asyncio.AbstractEventLoop
    cachemgr: subprocess.Popen[bytes]

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        """Run ``coro`` on the worker's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


def write_config(run_root: Path, models: dict[str, Path], dtype: str, sizes: RigSizes,
                 threads: int, weights: str = "copy", device: str = "cpu",
                 bases: dict[str, str] | None = None) -> Path:  # fmt: skip
    """The deployment YAML of the rig (one decode instance on ``device``, prefetch on;
    ``weights``: the worker's mode, ``copy`` by default since the rig measures
    scale-up copies; ``bases``: the LoRA adapters among ``models`` and their bases)."""
    bases = bases or {}
    raw = {
        "models": [{"name": n, "path": str(p), **({"base": bases[n]} if n in bases else {})}
                   for n, p in models.items()],
        "dtype": dtype,
        "run_dir": str(run_root / "run"),
        "cachemgr": {
            "model_cache": sizes.model_cache_bytes,
            "kv_cache": sizes.kv_cache_bytes,
            "slab": sizes.slab_bytes,
            "prewarm": ["*"],
            "event_slots": 64,
        },
        "decode": {
            "instances": 1,
            "device_memory": sizes.device_memory_bytes,
            "kv_memory": sizes.kv_memory_bytes,
            "threads": threads,
            "weights": weights,
            "device": device,
        },
        "scheduler": {"prefetch": True},
    }
    path = run_root / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _start_cachemgr(config_path: Path, config: Config, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        proc = subprocess.Popen(aegaeon_argv("cachemgr", "--config", str(config_path)),
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not is_ready(config.run_dir, "cachemgr", proc.pid):
        if proc.poll() is not None:
            raise RuntimeError(f"cachemgr exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            interrupt(proc, STOP_TIMEOUT_S, signal.SIGTERM)
            raise TimeoutError(f"cachemgr not ready after {START_TIMEOUT_S} s")
        time.sleep(0.02)
    return proc


def _wait_warm(rig: Rig, names: Sequence[str]) -> None:
    """Until every model is resident (the prewarm loads them one by one)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        stats = rig.worker.cache.stats().model_cache
        resident = {m.name for m in stats.models}
        if resident >= set(names):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Model Cache not warm: {sorted(set(names) - resident)} missing")
        time.sleep(0.05)


def make_run_root() -> Path:
    """A fresh temporary directory for the rig's config, log and run directory."""
    return Path(tempfile.mkdtemp(prefix="aegaeon-switch-bench-"))


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


@contextmanager
def switch_rig(models: dict[str, Path], dtype: str, sizes: RigSizes, threads: int = 1,
               weights: str = "copy", device: str = "cpu",
               bases: dict[str, str] | None = None) -> Iterator[Rig]:  # fmt: skip
    """A cachemgr process with every model of ``models`` warm, and a worker on it
    (``bases``: the LoRA adapters among them, as ``write_config``)."""
    from aegaeon_runtime.cacheclient.client import CacheClient
    from aegaeon_runtime.worker import build_worker

    run_root = make_run_root()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=_run_loop, args=(loop,), name="switch-bench-loop",
                              daemon=True)
    proc: subprocess.Popen[bytes] | None = None
    client: CacheClient | None = None
    worker: Worker | None = None
    prefix = ""
    try:
        config_path = write_config(run_root, models, dtype, sizes, threads, weights, device,
                                   bases)
        config = load_config(config_path)
        prefix = f"{config.shm_prefix}-"
        proc = _start_cachemgr(config_path, config, run_root / "cachemgr.log")
        thread.start()
        client = CacheClient(config.cachemgr_address, WORKER_ID)
        future = asyncio.run_coroutine_threadsafe(build_worker(config, "decode", 0, client), loop)
        worker = future.result(START_TIMEOUT_S)
        rig = Rig(config, worker, loop, proc)
        _wait_warm(rig, list(models))
        yield rig
    finally:
        if worker is not None:
            worker.close()
        if client is not None and thread.is_alive():
            asyncio.run_coroutine_threadsafe(client.close(), loop).result(STOP_TIMEOUT_S)
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(STOP_TIMEOUT_S)
        loop.close()
        if proc is not None:
            interrupt(proc, STOP_TIMEOUT_S, signal.SIGTERM)
        if prefix:
            # The cachemgr unlinks its segments on a clean stop; a killed one cannot.
            left = cleanup_prefix(prefix)
            if left:
                print(f"switch bench: removed segments the cachemgr left: {left}",
                      file=sys.stderr)
        shutil.rmtree(run_root, ignore_errors=True)
