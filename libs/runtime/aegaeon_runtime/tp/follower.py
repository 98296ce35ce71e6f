"""A follower of a tensor-parallel instance (rank >= 1): ``python -m aegaeon_runtime.tp.follower``.

Started by its instance's process (``group.start_group``) and dies with it.
It builds what a worker builds for its own device (engine, buffer, switcher
over the Model Cache, as ``<instance>.r<rank>`` at the cachemgr), joins the
group, hands rank 0 its KV region (``peer``), then runs the commands rank 0
broadcasts (``aegaeon_engine.tp_mirror.follow``) until told to stop: its
prefills and decode steps on its shard, and its switcher's switches,
prefetches and evictions (``group``'s ops).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from pathlib import Path

import torch
import zmq.asyncio
from aegaeon_common.config import load_config_or_exit
from aegaeon_common.logs import bind_process, get_logger
from aegaeon_common.process import run_service
from aegaeon_engine import CheckpointError, Engine, ModelSpec
from aegaeon_engine.tp import join_group, leave_group
from aegaeon_engine.tp_mirror import follow
from torch._C._distributed_c10d import TCPStore

from aegaeon_runtime.cacheclient.client import CacheClient, SyncCacheClient
from aegaeon_runtime.switcher import ModelSwitcher
from aegaeon_runtime.tp.group import (
    ACTIVATE,
    ADD_MODEL,
    EVICT,
    JOIN_TIMEOUT_S,
    PREFETCH,
    follower_name,
    words_text,
)
from aegaeon_runtime.tp.peer import export_kv, follower_buffer
from aegaeon_runtime.tp_shards import Shards

log = get_logger("tp")


async def run(config_path: Path, kind: str, index: int, rank: int, port: int,
              stop: asyncio.Event) -> None:
    config = load_config_or_exit(config_path, f"{kind} (tensor-parallel rank {rank})")
    inst = config.prefill if kind == "prefill" else config.decode
    device = torch.device(inst.group_devices(index)[rank])
    name = follower_name(f"{kind}-{index}", rank)
    bind_process(instance=name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = zmq.asyncio.Context()
    client = CacheClient(config.cachemgr_address, name, ctx)
    if device.type == "cuda":
        client.pin_host_memory()
    loop = asyncio.get_running_loop()
    cache = SyncCacheClient(client, loop)
    switcher: ModelSwitcher | None = None
    try:
        specs = {}
        for model in config.models:  # one rank 0 cannot read is not served (it says why)
            try:
                specs[model.name] = ModelSpec.from_dir(model.path)
            except (CheckpointError, OSError):
                continue
        shards = Shards(rank, inst.tp, config.dtype)
        # no CUDA graphs in a group: its collectives would have to be captured
        engine = await asyncio.to_thread(Engine, device, num_threads=inst.threads, graphs=False)
        shards.block_size = engine.block_size
        for spec_name, spec in specs.items():
            shards.add(spec_name, spec)
            await asyncio.to_thread(engine.tune, shards.spec(spec_name), config.dtype)
        buffer, keep = await asyncio.to_thread(
            follower_buffer, inst.device_memory_bytes, inst.kv_memory_bytes, device)
        # after what needs no cachemgr: the group may start beside it (aegaeon_runtime.worker)
        await client.register(os.getpid(), 1)
        store = TCPStore("127.0.0.1", port, is_master=False)
        group = await asyncio.to_thread(join_group, store, rank, inst.tp, device, JOIN_TIMEOUT_S)
        switcher = ModelSwitcher(engine, buffer, cache, specs, config.dtype,
                                 prefetch=config.scheduler.prefetch,
                                 map_weights=inst.maps_weights, shards=shards,
                                 reduce=group.all_reduce)  # fmt: skip
        store.set(f"kv/{rank}", json.dumps(export_kv(buffer, keep)))
        log.info("tp_follower_ready", instance=name, device=str(device))
        sw = switcher

        def add_model(words: list[int]) -> None:
            added, path = words_text(words, 2)
            sw.add_model(added, ModelSpec.from_dir(path))
            engine.tune(sw.spec(added), config.dtype)

        extra = {
            ACTIVATE: lambda w: sw.activate(words_text(w, 1)[0]),
            PREFETCH: lambda w: sw.prefetch(words_text(w, 1)[0]),
            EVICT: lambda w: sw.evict(words_text(w, 1)[0]),
            ADD_MODEL: add_model,
        }
        done: asyncio.Future[None] = loop.create_future()

        def serve() -> None:
            try:
                follow(engine, group, lambda _: False, extra)
            except BaseException as exc:  # rank 0 gone, or a command failed: said below
                loop.call_soon_threadsafe(_settle, done, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, None)

        # a daemon thread: a follower told to stop (its instance died: SIGTERM) leaves a
        # collective it is blocked in behind, as the process ends
        threading.Thread(target=serve, name=f"aegaeon-{name}", daemon=True).start()
        stopping: asyncio.Future[None] = asyncio.ensure_future(_wait(stop))
        await asyncio.wait([done, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not done.done():
            log.info("tp_follower_stopped", instance=name, why="signal")
            return
        error = done.result() if not done.cancelled() else None
        if error is not None:
            raise RuntimeError(f"{name}: the group's commands failed") from error
        log.info("tp_follower_stopped", instance=name, why="rank 0 said stop")
        leave_group()
    finally:
        if switcher is not None:
            switcher.close()
        await client.close()
        ctx.destroy(linger=0)


async def _wait(event: asyncio.Event) -> None:
    await event.wait()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aegaeon_runtime.tp.follower")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--kind", choices=("prefill", "decode"), required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    name = follower_name(f"{args.kind}-{args.index}", args.rank)
    # dies with its instance (rank 0): without it there is no group
    return run_service(name, lambda stop: run(args.config, args.kind, args.index, args.rank,
                                              args.port, stop))


if __name__ == "__main__":
    sys.exit(main())
