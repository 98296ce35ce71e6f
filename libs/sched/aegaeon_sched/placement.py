"""Where a node's instances run (``--gpus``); :mod:`aegaeon_sched.sizing` sizes them.

Pure: the machine's facts (its GPUs' free memory, the host's available
memory, the models' weight bytes) come in as arguments; ``aegaeon_cli.machine``
gathers them. The rules (docs/gpu.md says the same):

- **Placement.** ``--gpus all`` or ``--gpus 0,2``: the GPUs to use, by CUDA
  index. Prefill instances take them first, then decode instances, one per
  GPU in order. With more instances than GPUs they go round and round, and
  the instances on one GPU split it (one GPU: a prefill and a decode
  instance share it, as the paper's one-GPU set-up). Counts the config does
  not give: half of the GPUs prefill, the rest decode (one GPU: one of each).
- **Reserve.** Each GPU keeps back :func:`gpu_reserve_bytes` (10% of its
  memory, at least 1 GiB per instance on it: CUDA context, activations, the
  tensor library's workspace); the sizes are :mod:`aegaeon_sched.sizing`'s.
- **Tensor parallelism.** An instance may be a group of ``tp`` GPUs (one set of
  weights sharded across them): groups take ``tp`` GPUs in order, prefill
  groups first, round and round as single GPUs do.
- **Containers.** From the cachemgr's sizes: the ``/dev/shm`` it needs
  (``shm_size``: Model Cache + CPU KV cache + 1 GiB, whole GiB) and a health
  check start period (60 s + the Model Cache filled from disk at 500 MB/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CachePlan",
    "ContainerPlan",
    "GpuInfo",
    "HostInfo",
    "InstancePlan",
    "KindPlan",
    "PlacementError",
    "Plan",
    "TPSizes",
    "default_counts",
    "gpu_reserve_bytes",
    "place",
]

MiB = 1 << 20
GiB = 1 << 30
RESERVE_FRACTION = 0.10  # of a GPU's memory, kept back (docs/gpu.md: ~10%)
RESERVE_MIN_BYTES = 1 * GiB  # per instance on a GPU: its CUDA context and activations
SHM_MARGIN_BYTES = 1 * GiB  # /dev/shm beyond the caches: event table, registrations
START_BASE_S = 60.0  # a container's start before its models: engine, kernels, profile
DISK_BYTES_PER_S = 500e6  # what the start period assumes a Model Cache fills at


class PlacementError(ValueError):
    """A ``--gpus`` spec or a plan the machine cannot hold; the message says why."""


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as ``torch.cuda`` sees it (``index``: its CUDA index)."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


@dataclass(frozen=True)
class HostInfo:
    """The host's memory: MemAvailable and /dev/shm's free bytes (None: unknown)."""

    mem_available_bytes: int
    shm_free_bytes: int | None = None


@dataclass(frozen=True)
class TPSizes:
    """A model's bytes at one tensor-parallel size."""

    per_gpu: int  # on the GPU holding the most of it: its largest shard, or all of it
    cached: int  # its Model Cache region: every shard back to back, or the whole model


@dataclass(frozen=True)
class InstancePlan:
    """Instance ``index`` of ``kind`` on ``gpus`` (its tensor-parallel group, rank 0
    first; one GPU without TP); ``sharing``: the most instances any of them holds."""

    kind: str
    index: int
    gpus: tuple[GpuInfo, ...]
    sharing: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    @property
    def gpu(self) -> GpuInfo:
        """The group's first GPU (rank 0's)."""
        return self.gpus[0]


@dataclass(frozen=True)
class KindPlan:
    """The sizes every instance of one kind gets (the config's sections are homogeneous)."""

    kind: str
    devices: tuple[str, ...]  # every instance's group in turn (tp devices each)
    device_memory_bytes: int  # per device (each rank of a group)
    kv_memory_bytes: int
    weights_bytes: int
    prefetch_room: bool  # the arena holds two of the largest model (its largest shard)
    tp: int = 1

    @property
    def instances(self) -> int:
        return len(self.devices) // self.tp


@dataclass(frozen=True)
class CachePlan:
    """The cachemgr's sizes and what they came from."""

    model_cache_bytes: int
    kv_cache_bytes: int
    budget_bytes: int
    models_bytes: int  # every model, as the Model Cache holds them
    holds_all: bool


@dataclass(frozen=True)
class ContainerPlan:
    """What compose needs beside the config: the cachemgr's ``/dev/shm`` and how long a
    container may take to start before its health check counts."""

    shm_bytes: int
    start_period_s: int

    @property
    def shm_size(self) -> str:
        """``shm_size`` as compose writes it (``52g``: GiB)."""
        return f"{self.shm_bytes // GiB}g"

    def env(self) -> dict[str, str]:
        """The ``.env`` settings compose.yaml reads."""
        return {"AEGAEON_SHM_SIZE": self.shm_size,
                "AEGAEON_START_PERIOD": f"{self.start_period_s}s"}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What ``--gpus`` chose: instances on GPUs, their sizes, the cachemgr's sizes."""

    spec: str | None
    instances: tuple[InstancePlan, ...] = ()
    kinds: tuple[KindPlan, ...] = ()
    cache: CachePlan | None = None
    unused: tuple[GpuInfo, ...] = ()
    host: HostInfo | None = None
    largest_model: str = ""
    largest_bytes: int = 0
    dtype: str = ""
    tp: int = 1
    # the models that run whole on a group's first GPU (they do not split tp ways)
    unsharded: tuple[str, ...] = ()

    def kind(self, kind: str) -> KindPlan | None:
        return next((k for k in self.kinds if k.kind == kind), None)

    @property
    def containers(self) -> ContainerPlan | None:
        """compose's settings from the cachemgr's sizes (None: no host planned)."""
        if self.cache is None:
            return None
        held = self.cache.model_cache_bytes + self.cache.kv_cache_bytes
        shm = -(-(held + SHM_MARGIN_BYTES) // GiB) * GiB
        loaded = min(self.cache.models_bytes, self.cache.model_cache_bytes)
        start = START_BASE_S + loaded / DISK_BYTES_PER_S
        return ContainerPlan(shm, int(-(-start // 10) * 10))

    def describe(self) -> str:
        """What was chosen and why, a line each (printed at start, kept in the run dir)."""
        lines = [f"GPU plan (--gpus {self.spec}):" if self.spec else "Memory plan:"]
        gpus: dict[int, GpuInfo] = {}
        names: dict[int, list[str]] = {}
        for inst in self.instances:
            for rank, gpu in enumerate(inst.gpus):
                gpus[gpu.index] = gpu
                names.setdefault(gpu.index, []).append(
                    inst.name + (f" rank {rank}" if self.tp > 1 else ""))
        for index, placed in names.items():
            gpu = gpus[index]
            kept = gpu_reserve_bytes(gpu, len(placed))
            lines.append(f"  {gpu.device} {gpu.name}: {in_gib(gpu.free_bytes)} free of "
                         f"{in_gib(gpu.total_bytes)}, {in_gib(kept)} kept back -> "
                         f"{', '.join(placed)}")  # fmt: skip
        for gpu in self.unused:
            lines.append(f"  {gpu.device} {gpu.name}: unused (more GPUs than instances)")
        for k in self.kinds:
            twice = "twice: active + prefetched" if k.prefetch_room else "once: no room to prefetch"
            model = f"{self.largest_model}, {in_gib(self.largest_bytes)} in {self.dtype}"
            if k.tp > 1:
                lines.append(
                    f"  {k.kind} x{k.instances} (tensor parallel, {k.tp} GPUs each): device "
                    f"memory {in_gib(k.device_memory_bytes)} per GPU = weights "
                    f"{in_gib(k.weights_bytes)} (the largest model's shard, {model} split "
                    f"{k.tp} ways, {twice}) + KV {in_gib(k.kv_memory_bytes)}"
                )
            else:
                lines.append(
                    f"  {k.kind} x{k.instances}: device memory {in_gib(k.device_memory_bytes)} "
                    f"each = weights {in_gib(k.weights_bytes)} (the largest model, {model}, "
                    f"{twice}) + KV {in_gib(k.kv_memory_bytes)}"
                )
        if self.tp > 1 and self.unsharded:
            lines.append(f"  whole on a group's first GPU (they do not split {self.tp} ways): "
                         f"{', '.join(self.unsharded)}")  # fmt: skip
        cache, host = self.cache, self.host
        if cache is not None and host is not None:
            shm = (f", /dev/shm {in_gib(host.shm_free_bytes)} free"
                   if host.shm_free_bytes is not None else "")  # fmt: skip
            lines.append(f"  host: MemAvailable {in_gib(host.mem_available_bytes)}{shm} -> budget "
                         f"{in_gib(cache.budget_bytes)} (half of MemAvailable, at most 90% of "
                         f"/dev/shm)")  # fmt: skip
            held = ("every model" if cache.holds_all else
                    f"capped: the models need {in_gib(cache.models_bytes)}; the rest load from "
                    "disk on demand, least recently used evicted")  # fmt: skip
            lines.append(
                f"  Model Cache {in_gib(cache.model_cache_bytes)} ({held}); CPU KV cache "
                f"{in_gib(cache.kv_cache_bytes)} (a quarter of the budget, 1-64 GiB)"
            )
        containers = self.containers
        if containers is not None:
            settings = " ".join(f"{k}={v}" for k, v in containers.env().items())
            lines.append(
                f"  compose (.env): {settings} (shm_size: Model Cache + CPU KV cache + 1 GiB; "
                f"start period: {START_BASE_S:.0f} s + the Model Cache filled from disk at "
                f"{DISK_BYTES_PER_S / 1e6:.0f} MB/s)"
            )
        return "\n".join(lines)


def in_gib(nbytes: int) -> str:
    """``nbytes`` as the plan's lines write it: ``12.3 GiB``."""
    return f"{nbytes / GiB:.1f} GiB"


def default_counts(num_gpus: int, prefill: int | None, decode: int | None) -> tuple[int, int]:
    """Instance counts: the config's where it gives them; else half of the GPUs
    prefill and the rest decode, at least one of each (one GPU: one of each)."""
    if prefill is None and decode is None:
        prefill = max(1, num_gpus // 2)
        decode = max(1, num_gpus - prefill)
    elif prefill is None:
        assert decode is not None
        prefill = max(1, num_gpus - decode)
    elif decode is None:
        decode = max(1, num_gpus - prefill)
    if prefill < 0 or decode < 0 or prefill + decode < 1:
        raise PlacementError(f"instances: {prefill} prefill + {decode} decode, need at least one")
    return prefill, decode


def place(gpus: Sequence[GpuInfo], prefill: int, decode: int, tp: int = 1) -> list[InstancePlan]:
    """Prefill instances, then decode instances, each on the next ``tp`` GPUs in order,
    round and round when there are more than the GPUs hold (those share a GPU)."""
    if not gpus:
        raise PlacementError("no GPU to place instances on")
    if tp > len(gpus):
        raise PlacementError(f"tensor parallelism {tp} needs {tp} GPUs, the plan has "
                             f"{len(gpus)}")  # fmt: skip
    slots = [("prefill", i) for i in range(prefill)] + [("decode", j) for j in range(decode)]
    groups = [tuple(gpus[(n * tp + r) % len(gpus)] for r in range(tp)) for n in range(len(slots))]
    sharing = {g.index: sum(1 for grp in groups for o in grp if o.index == g.index) for g in gpus}
    return [InstancePlan(kind, index, group, max(sharing[g.index] for g in group))
            for (kind, index), group in zip(slots, groups, strict=True)]  # fmt: skip


def gpu_reserve_bytes(gpu: GpuInfo, instances: int) -> int:
    """What a GPU keeps back from its instances: 10% of it, at least 1 GiB each."""
    return max(int(gpu.total_bytes * RESERVE_FRACTION), RESERVE_MIN_BYTES * instances)
