"""Everything one worker process builds once at start (paper §5.1, component reuse).

The device buffer (weights arena + device KV region), the engine, the
sampler, the copy streams, the cachemgr lease and every model's spec are made
here once; serving only rebinds views. A model whose checkpoint cannot be read
does not stop the worker: its spec left out (an unreadable ``config.json``) or
its weights refused by the cachemgr, it is noted in ``Worker.unavailable`` and
the worker serves the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aegaeon_common.config import Config, InstancesConfig
from aegaeon_common.logs import get_logger
from aegaeon_common.transport import RemoteError
from aegaeon_engine import CheckpointError, Engine, KVShape, ModelSpec, Sampler
from aegaeon_engine.tp_mirror import MirroredEngine
from aegaeon_gpumem import DeviceBuffer, make_copy_stream
from aegaeon_sched import ModelSpec as SchedSpec

from aegaeon_runtime.adapters import AdapterResidency
from aegaeon_runtime.cacheclient.client import CacheClient, SyncCacheClient
from aegaeon_runtime.cacheclient.mapped import Registration
from aegaeon_runtime.grammar import GrammarCache, ModelVocab
from aegaeon_runtime.kv import KVSpace
from aegaeon_runtime.metrics import WorkerMetrics
from aegaeon_runtime.switcher import ModelSwitcher, keeps_resident, prefetches
from aegaeon_runtime.tp.group import InstanceGroup, start_group
from aegaeon_runtime.tp_shards import Shards

log = get_logger("worker")

# Copy streams per worker: one slot each in the cachemgr's event table.
SWAP_OUT, SWAP_IN = 0, 1
NUM_STREAMS = 2


def instance_config(config: Config, kind: str) -> InstancesConfig:
    """Prefill instances use ``prefill``; decode and unified instances ``decode``."""
    return config.prefill if kind == "prefill" else config.decode


@dataclass
class Worker:
    """One worker's long-lived components.

    ``specs`` holds every served model, a LoRA adapter with its base's spec (its
    KV shape and window are the base's); ``adapters`` knows which are adapters
    and brings their matrices to the device; the switcher switches bases only.
    """

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
    adapters: AdapterResidency
    # what the compute thread counts for /metrics (a registry of its own by default)
    metrics: WorkerMetrics = field(default_factory=lambda: WorkerMetrics("worker"))
    # models whose checkpoint could not be read at start -> why (left out of the
    # start-up profile; the cachemgr refuses them until the operator reloads them)
    unavailable: dict[str, str] = field(default_factory=dict)
    # a tensor-parallel instance's group (rank 0's handle); None: one device
    group: InstanceGroup | None = None
    # every model's checkpoint directory (its tokenizer, for constrained decoding)
    model_dirs: dict[str, Path] = field(default_factory=dict)
    grammars: GrammarCache = field(init=False)

    def __post_init__(self) -> None:
        self.grammars = GrammarCache(self.model_vocab)

    def model_vocab(self, model: str) -> ModelVocab:
        """What ``model``'s grammar matchers need (its tokenizer, logits width, EOS)."""
        spec = self.specs[model]
        return ModelVocab(self.model_dirs[model] / "tokenizer.json", spec.vocab_size,
                          spec.eos_token_ids)  # fmt: skip

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    def kv_shape(self, model: str) -> KVShape:
        """``model``'s KV blocks as the node counts them (a tensor-parallel group's
        sharded model: every rank's part, ``aegaeon_runtime.tp_shards``; a LoRA
        adapter's: its base's)."""
        return self.switcher.shards.kv_shape(self.unit_of(model))

    def max_model_len(self, model: str) -> int:
        return self.specs[model].max_model_len

    def unit_of(self, model: str) -> str:
        """The model whose weights serve ``model``: its base for an adapter, else itself."""
        return self.adapters.base_of(model) or model

    def sched_spec(self, model: str) -> SchedSpec:
        """What the latency model (Eq. 4-6) needs of ``model`` (an adapter: its base's
        sizes; its own bytes are what moving it to the device costs)."""
        spec = self.specs[model]
        shape = self.kv_shape(model)
        adapter = model in self.adapters.specs
        return SchedSpec(
            name=model,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_layers=spec.num_layers,
            weight_bytes=self.adapters.nbytes(model) if adapter else self.switcher.nbytes(model),
            kv_bytes_per_token=shape.block_bytes // shape.block_size,
        )

    def capacity_tokens(self) -> dict[str, int]:
        """Device KV capacity in tokens of each model's KV shape (its hello's)."""
        block = self.engine.block_size
        return {m: self.kv.capacity_blocks(self.kv_shape(m)) * block for m in list(self.specs)}

    def add_model(self, name: str, path: Path, base: str | None = None) -> SchedSpec:
        """Serve one more model (``AddModel``, on the compute thread): its spec is read
        from ``path`` (``CheckpointError`` if broken); its weights come through the
        Model Cache at its first switch, as every model's. On a GPU its decode step's
        CUDA graphs are captured now (where a scale-up lands), not at a served step.
        With ``base`` (a served model), ``path`` is a LoRA adapter of it, checked
        against its shapes (a step of adapters runs eagerly, without graphs)."""
        if base is not None:
            if base not in self.switcher.specs:
                raise CheckpointError(path, None, f"its base {base!r} is not served here")
            self.adapters.add(name, path, self.specs[base])
            spec, model_dir = self.specs[base], self.model_dirs[base]  # its base's tokenizer
        else:
            spec, model_dir = ModelSpec.from_dir(path), Path(path)
            if self.group is not None:  # the followers first: the next switch may need it
                self.group.add_model(name, str(path))
            self.switcher.forget_bytes(name)  # one of that name served before had other bytes
            self.switcher.add_model(name, spec)
            self.engine.tune(self.switcher.spec(name), self.config.dtype)
        self.specs[name], self.model_dirs[name] = spec, model_dir
        self.grammars.forget(name)
        if base is None:
            self.capture_graphs([name])
        return self.sched_spec(name)

    def capture_graphs(self, names: Iterable[str]) -> None:
        """Capture the CUDA graphs of these models' layouts at arena offset 0, where a
        scale-up copies a model (``ModelSwitcher``), and log what it cost; nothing
        without graphs (the CPU, ``cuda_graphs: false``). A layout seen before costs
        nothing; a failed capture leaves that model's steps eager (logged)."""
        stats = self.engine.graph_stats
        if not stats.enabled:
            return
        before_n, before_s = stats.captures, stats.capture_s
        captured: list[str] = []
        failed: list[str] = []
        for name in names:
            nbytes = self.switcher.nbytes(name)
            if nbytes > self.buffer.weights_capacity:
                continue  # it never lands here; its switch says so
            ok = self.engine.capture_graphs(self.switcher.spec(name), self.buffer.view(0, nbytes),
                                            self.buffer.kv_region, self.config.dtype)
            (captured if ok else failed).append(name)
        log.info("cuda_graphs_captured", worker=self.name, models=captured, failed=failed,
                 graphs=stats.captures - before_n,
                 seconds=round(stats.capture_s - before_s, 4), sizes=list(stats.sizes))

    def close(self) -> None:
        self.grammars.close()
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
    """Build the worker (its slow parts on threads) and register with the cachemgr.

    What needs no cachemgr comes first (a tensor-parallel group's followers are
    started at once, to build theirs meanwhile; the specs, the engine, the buffer):
    an instance starts beside its cachemgr (``aegaeon_cli.node``) and its
    registration waits until the cachemgr answers (``CacheClient.register``).
    Must be awaited on the loop that will serve ``client`` afterwards: the
    compute thread reaches the cachemgr through a :class:`SyncCacheClient`.
    """
    inst = instance_config(config, kind)
    device = torch.device(inst.device_of(index))
    if device.type == "cuda":
        if device.index is not None:  # streams, events and the stage buffer follow it
            torch.cuda.set_device(device)
        client.pin_host_memory()  # scale-ups and KV copies as single DMAs
    # the followers import and build their engines while this process builds its own
    forming = (asyncio.ensure_future(asyncio.to_thread(start_group, config, kind, index))
               if inst.tp > 1 else None)  # fmt: skip
    try:
        return await _build(config, kind, index, client, metrics, device, forming)
    except BaseException:
        if forming is not None:  # a group formed meanwhile ends with this start
            with contextlib.suppress(Exception):
                (await forming).close()
        raise


async def _build(
    config: Config,
    kind: str,
    index: int,
    client: CacheClient,
    metrics: WorkerMetrics | None,
    device: torch.device,
    forming: asyncio.Future[InstanceGroup] | None,
) -> Worker:
    inst = instance_config(config, kind)
    loop = asyncio.get_running_loop()
    cache = SyncCacheClient(client, loop)
    specs: dict[str, ModelSpec] = {}
    unavailable: dict[str, str] = {}
    for model in config.models:
        if model.base is not None:
            continue  # a LoRA adapter: checked against its base below
        try:
            specs[model.name] = ModelSpec.from_dir(model.path)
        except (CheckpointError, OSError) as exc:  # served without it (the proxy says why)
            unavailable[model.name] = str(exc)
            log.error("model_unavailable", model=model.name, error=str(exc))
    # Off the loop: the engine may build its native kernels (tens of seconds on a
    # machine that has none yet) and the buffer touches every page; the loop keeps
    # answering /health meanwhile. A tensor-parallel instance's engine mirrors its
    # calls to its group (aegaeon_runtime.tp.group), and runs without CUDA graphs (its
    # collectives would have to be captured on every rank).
    engine_class = MirroredEngine if inst.tp > 1 else Engine
    graphs = None if inst.cuda_graphs and inst.tp == 1 else False
    engine = await asyncio.to_thread(engine_class, device, num_threads=inst.threads,
                                     graphs=graphs)
    shards = Shards(0, inst.tp, config.dtype, engine.block_size)
    for name, spec in specs.items():  # the fastest kernels per shape, measured once a machine
        shards.add(name, spec)
        await asyncio.to_thread(engine.tune, shards.spec(name), config.dtype)
    adapter_bytes = 0 if inst.maps_weights else inst.adapter_region_bytes
    buffer = await asyncio.to_thread(DeviceBuffer, inst.device_memory_bytes,
                                     inst.kv_memory_bytes, device,
                                     adapter_bytes=adapter_bytes)  # fmt: skip
    registration = await client.register(os.getpid(), NUM_STREAMS)
    group = None
    if forming is not None:  # shielded: a stop or failure leaves it to build_worker to close
        group = await asyncio.shield(forming)
        assert isinstance(engine, MirroredEngine)
        engine.group = group.tp
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
        prefetch=prefetches(config.scheduler),
        map_weights=inst.maps_weights,
        keep_resident=keeps_resident(config.scheduler),
        shards=shards,
        reduce=group.tp.all_reduce if group is not None else None,
        mirror=group,
    )
    adapters = AdapterResidency(cache, config.dtype,
                                buffer.adapter_region if adapter_bytes else None,
                                engine.lora_stacks)  # fmt: skip
    for model in config.models:  # LoRA adapters: checked against their bases now
        if model.base is None:
            continue
        if model.base not in specs:
            unavailable[model.name] = (f"its base {model.base!r} is unavailable: "
                                       f"{unavailable.get(model.base, 'not served')}")
            continue
        try:
            adapters.add(model.name, model.path, specs[model.base])
        except (CheckpointError, OSError) as exc:  # served without it, as a broken model
            unavailable[model.name] = str(exc)
            log.error("model_unavailable", model=model.name, error=str(exc))
    for name in specs:  # map every Model Cache region now, off the critical path
        try:
            await client.load_model(name, pin=True)
        except RemoteError as exc:
            if exc.code != "checkpoint_error":
                raise
            unavailable[name] = exc.reply.message  # quarantined there; the rest is served
            log.error("model_unavailable", model=name, error=exc.reply.message)
            continue
        await client.unpin(name)
    by_name = {m.name: m for m in config.models}
    for model in config.models:  # the served adapters with them
        if model.base is not None and model.name in adapters.specs:
            specs[model.name] = specs[model.base]
    worker = Worker(
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
        adapters=adapters,
        metrics=metrics or WorkerMetrics(f"{kind}-{index}"),
        group=group,
        unavailable=unavailable,
        # an adapter's tokenizer is its base's
        model_dirs={m.name: Path(by_name[m.base].path if m.base else m.path)
                    for m in config.models},
    )
    # the decode step's CUDA graphs, one set per layout, before the first step (a GPU)
    await asyncio.to_thread(worker.capture_graphs, list(switcher.specs))
    return worker
