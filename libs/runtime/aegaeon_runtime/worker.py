"""Everything one worker process builds once at start (paper §5.1, component reuse).

The device buffer (weights arena + device KV region), the engine, the
sampler, the copy streams, the cachemgr lease and every model's spec are made
here once; serving only rebinds views.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aegaeon_common.config import Config, InstancesConfig
from aegaeon_engine import Engine, KVShape, ModelSpec, Sampler
from aegaeon_engine.tp_mirror import MirroredEngine
from aegaeon_gpumem import DeviceBuffer, make_copy_stream
from aegaeon_sched import ModelSpec as SchedSpec

from aegaeon_runtime.cacheclient.client import CacheClient, SyncCacheClient
from aegaeon_runtime.cacheclient.mapped import Registration
from aegaeon_runtime.kv import KVSpace
from aegaeon_runtime.metrics import WorkerMetrics
from aegaeon_runtime.switcher import ModelSwitcher
from aegaeon_runtime.tp.group import InstanceGroup, start_group
from aegaeon_runtime.tp_shards import Shards

# Copy streams per worker: one slot each in the cachemgr's event table.
SWAP_OUT, SWAP_IN = 0, 1
NUM_STREAMS = 2


def instance_config(config: Config, kind: str) -> InstancesConfig:
    """Prefill instances use ``prefill``; decode and unified instances ``decode``."""
    return config.prefill if kind == "prefill" else config.decode


@dataclass
class Worker:
    """One worker's long-lived components."""

    config: Config
    kind: str
    index: int
    specs: dict[str, ModelSpec]
    engine: Engine
    buffer: DeviceBuffer
    client: CacheClient
    cache: SyncCacheClient
    registration: Registration
    switcher: ModelSwitcher
    kv: KVSpace
    sampler: Sampler
    # what the compute thread counts for /metrics (a registry of its own by default)
    metrics: WorkerMetrics = field(default_factory=lambda: WorkerMetrics("worker"))
    # a tensor-parallel instance's group (rank 0's handle); None: one device
    group: InstanceGroup | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    def kv_shape(self, model: str) -> KVShape:
        """``model``'s KV blocks as the node counts them (a tensor-parallel group's
        sharded model: every rank's part, ``aegaeon_runtime.tp_shards``)."""
        return self.switcher.shards.kv_shape(model)

    def max_model_len(self, model: str) -> int:
        return self.specs[model].max_model_len

    def sched_spec(self, model: str) -> SchedSpec:
        """What the latency model (Eq. 4-6) needs of ``model``."""
        spec = self.specs[model]
        shape = self.kv_shape(model)
        return SchedSpec(
            name=model,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_layers=spec.num_layers,
            weight_bytes=self.switcher.nbytes(model),
            kv_bytes_per_token=shape.block_bytes // shape.block_size,
        )

    def capacity_tokens(self) -> dict[str, int]:
        """Device KV capacity in tokens of each model's KV shape (its hello's)."""
        block = self.engine.block_size
        return {m: self.kv.capacity_blocks(self.kv_shape(m)) * block for m in list(self.specs)}

    def add_model(self, name: str, path: Path) -> SchedSpec:
        """Serve one more model (``AddModel``, on the compute thread): its spec is read
        from ``path`` (``CheckpointError`` if broken); its weights come through the
        Model Cache at its first switch, as every model's."""
        spec = ModelSpec.from_dir(path)
        if self.group is not None:  # the followers first: the next switch may need it
            self.group.add_model(name, str(path))
        self.switcher.add_model(name, spec)
        self.engine.tune(self.switcher.spec(name), self.config.dtype)
        self.specs[name] = spec
        return self.sched_spec(name)

    def close(self) -> None:
        self.switcher.close()
        self.kv.close()
        if self.group is not None:
            self.group.close()


async def build_worker(
    config: Config,
    kind: str,
    index: int,
    client: CacheClient,
    metrics: WorkerMetrics | None = None,
) -> Worker:
    """Register with the cachemgr and build the worker (its slow parts on threads).

    Must be awaited on the loop that will serve ``client`` afterwards: the
    compute thread reaches the cachemgr through a :class:`SyncCacheClient`.
    """
    import asyncio

    inst = instance_config(config, kind)
    device = torch.device(inst.device_of(index))
    if device.type == "cuda":
        if device.index is not None:  # streams, events and the stage buffer follow it
            torch.cuda.set_device(device)
        client.pin_host_memory()  # scale-ups and KV copies as single DMAs
    registration = await client.register(os.getpid(), NUM_STREAMS)
    loop = asyncio.get_running_loop()
    cache = SyncCacheClient(client, loop)
    specs = {m.name: ModelSpec.from_dir(m.path) for m in config.models}
    # Off the loop: the engine may build its native kernels (tens of seconds on a
    # machine that has none yet) and the buffer touches every page; the loop keeps
    # answering /health meanwhile. A tensor-parallel instance's engine mirrors its
    # calls to its group (aegaeon_runtime.tp.group).
    engine_class = MirroredEngine if inst.tp > 1 else Engine
    engine = await asyncio.to_thread(engine_class, device, num_threads=inst.threads)
    shards = Shards(0, inst.tp, config.dtype, engine.block_size)
    for name, spec in specs.items():  # the fastest kernels per shape, measured once a machine
        shards.add(name, spec)
        await asyncio.to_thread(engine.tune, shards.spec(name), config.dtype)
    buffer = await asyncio.to_thread(DeviceBuffer, inst.device_memory_bytes,
                                     inst.kv_memory_bytes, device)  # fmt: skip
    group = None
    if inst.tp > 1:
        group = await asyncio.to_thread(start_group, config, kind, index)
        assert isinstance(engine, MirroredEngine)
        engine.group = group.tp
    try:
        table = registration.event_table
        streams = [make_copy_stream(device, table, registration.event_slots[i])
                   for i in range(NUM_STREAMS)]  # fmt: skip
        kv = KVSpace(
            buffer.kv_region,
            registration.kv_tensor,
            cache,
            streams[SWAP_OUT],
            streams[SWAP_IN],
            registration.slab_bytes,
            peers=group.peer_tensors if group is not None else (),
        )
        switcher = ModelSwitcher(
            engine,
            buffer,
            cache,
            specs,
            config.dtype,
            prefetch=config.scheduler.prefetch,
            map_weights=inst.maps_weights,
            shards=shards,
            reduce=group.tp.all_reduce if group is not None else None,
            mirror=group,
        )
        for name in specs:  # map every Model Cache region now, off the critical path
            await client.load_model(name, pin=True)
            await client.unpin(name)
    except BaseException:
        if group is not None:
            group.close()
        raise
    return Worker(
        config=config,
        kind=kind,
        index=index,
        specs=specs,
        engine=engine,
        buffer=buffer,
        client=client,
        cache=cache,
        registration=registration,
        switcher=switcher,
        kv=kv,
        sampler=Sampler(device),
        metrics=metrics or WorkerMetrics(f"{kind}-{index}"),
        group=group,
    )
