"""The process shell every instance shares: sockets, lease, heartbeat, compute thread.

An instance is an asyncio program whose loop only moves messages: commands
from the proxy go to the compute thread's inbox; messages the compute thread
produces go back to the proxy in order; a heartbeat reports stats. Torch runs
only on the compute thread (an :class:`InstanceLoop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Callable
from typing import Protocol

import zmq.asyncio
from aegaeon_cachemgr.client import CacheClient
from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.process import mark_ready, ready_path
from aegaeon_common.transport import Puller, Pusher
from aegaeon_common.wire import Channel, Message, WireError
from aegaeon_sched import LatencyModel

from aegaeon_runtime.bridge import ComputeThread, Inbox, Outbox
from aegaeon_runtime.worker import Worker, build_worker, instance_config

log = get_logger("instance")

HEARTBEAT_S = 0.5


class InstanceLoop(Protocol):
    """What runs on an instance's compute thread.

    ``run`` first profiles the worker (the latency model of its start-up
    profile goes in ``latency``) and then sets ``ready``; the instance
    announces itself only then.
    """

    ready: threading.Event
    latency: LatencyModel | None

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (drain ``inbox``, compute, send via ``outbox``)."""

    def stats(self) -> InstanceStats:
        """A snapshot for the heartbeat (called on the event loop's thread)."""


LoopFactory = Callable[[Worker, Inbox[Message], Outbox], InstanceLoop]


def _hello(worker: Worker, instance: InstanceLoop) -> InstanceHello:
    inst = instance_config(worker.config, worker.kind)
    capacity = {
        m: worker.kv.capacity_blocks(worker.kv_shape(m)) * worker.engine.block_size
        for m in worker.specs
    }
    latency = json.dumps(instance.latency.to_dict()) if instance.latency else ""
    return InstanceHello(
        kind=worker.kind,
        index=worker.index,
        pid=os.getpid(),
        kv_capacity_bytes=inst.kv_memory_bytes,
        weights_capacity_bytes=worker.buffer.weights_capacity,
        max_batch_size=worker.config.scheduler.max_batch_size,
        capacity_tokens=capacity,
        latency_json=latency,
    )


def instance_address(config: Config, kind: str, index: int) -> str:
    return config.prefill_address(index) if kind == "prefill" else config.decode_address(index)


async def serve_instance(
    config: Config,
    kind: str,
    index: int,
    channel: Channel,
    make_loop: LoopFactory,
    stop: asyncio.Event,
) -> None:
    """Run one instance until ``stop``; raises if the compute thread crashes."""
    name = f"{kind}-{index}"
    ctx = zmq.asyncio.Context()
    client = CacheClient(config.cachemgr_address, name, ctx)
    worker = await build_worker(config, kind, index, client)
    loop = asyncio.get_running_loop()
    commands = Puller(ctx, instance_address(config, kind, index), channel, bind=True)
    to_proxy = Pusher(ctx, config.proxy_address)
    inbox: Inbox[Message] = Inbox()
    outbox = Outbox(config.proxy_address)
    instance = make_loop(worker, inbox, outbox)
    crashed: list[BaseException] = []

    def on_crash(exc: BaseException) -> None:
        crashed.append(exc)
        stop.set()

    compute = ComputeThread(f"aegaeon-{name}", instance.run, loop, on_crash)
    compute.start()
    while not instance.ready.is_set():  # the start-up profile (needs this loop running)
        await asyncio.sleep(0.05)
        if crashed:
            raise RuntimeError(f"{name}: compute thread crashed") from crashed[0]
    hello = _hello(worker, instance)

    async def receive() -> None:
        while True:
            try:
                inbox.put(await commands.recv())
            except WireError as exc:  # nobody to answer on PULL: count and go on
                log.warning("bad command frame", error=str(exc))

    async def heartbeat() -> None:
        while True:
            await to_proxy.send(hello)  # cheap; lets a restarted proxy learn us again
            await to_proxy.send(instance.stats())
            await asyncio.sleep(HEARTBEAT_S)

    tasks = [loop.create_task(t) for t in (receive(), heartbeat())]
    mark_ready(config.run_dir, name)
    log.info("ready", instance=name, models=len(worker.specs))
    try:
        await stop.wait()
    finally:
        compute.join()
        outbox.close()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        worker.close()
        await client.close()
        commands.close()
        to_proxy.close()
        ctx.term()
        ready_path(config.run_dir, name).unlink(missing_ok=True)
    if crashed:
        raise RuntimeError(f"{name}: compute thread crashed") from crashed[0]
