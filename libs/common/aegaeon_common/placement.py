"""Where a node's instances run and how much memory each gets (``--gpus``).

Pure: the machine's facts (its GPUs' free memory, the host's available
memory, the models' weight bytes) come in as arguments; ``aegaeon_cli.machine``
gathers them. The rules (docs/gpu.md says the same):

- **Placement.** ``--gpus all`` or ``--gpus 0,2``: the GPUs to use, by CUDA
  index. Prefill instances take them first, then decode instances, one per
  GPU in order. With more instances than GPUs they go round and round, and
  the instances on one GPU split it (one GPU: a prefill and a decode
  instance share it, as the paper's one-GPU set-up). Counts the config does
  not give: half of the GPUs prefill, the rest decode (one GPU: one of each).
- **Device memory.** Each GPU keeps back :func:`gpu_reserve_bytes` (10% of
  its memory, at least 1 GiB per instance on it: CUDA context, activations,
  the tensor library's workspace); the rest of its *free* memory is split
  evenly between its instances. The instances of a kind share one size (the
  config's sections are homogeneous): the smallest share among them.
- **KV region.** Device memory less the weights arena: twice the largest
  model plus a margin (active + prefetched) when that leaves at least a
  quarter of the device memory and 1 GiB for KV, else once (no room to
  prefetch); a model that does not fit with 1 GiB of KV is an error naming it.
- **Host.** The budget is half of MemAvailable, at most 90% of /dev/shm's free
  space (the Model Cache and the CPU KV cache live there). CPU KV cache: a
  quarter of the budget, between 1 and 64 GiB. Model Cache: every model of the
  deployment when the rest of the budget holds them, else the rest (the
  cache then evicts, least recently used); at least the largest model.
- **Tensor parallelism.** An instance may be a group of ``tp`` GPUs (one
  set of weights sharded across them). Given each model's bytes per rank at
  each size (``shards``: a model whose heads do not split runs whole on the
  group's first GPU), a plan without a ``tp`` of its own takes the smallest
  size (1, 2, 4, 8, ...) whose largest shard fits a GPU's share with 1 GiB of
  KV; groups take ``tp`` GPUs in order, prefill groups first.
- **Containers.** From the cachemgr's sizes: the ``/dev/shm`` it needs
  (``shm_size``: Model Cache + CPU KV cache + 1 GiB, whole GiB) and a health
  check start period (60 s + the Model Cache filled from disk at 500 MB/s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

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
    "apply_plan",
    "assumed_gpus",
    "default_counts",
    "gpu_reserve_bytes",
    "parse_gpus",
    "place",
    "plan_cache",
    "plan_instances",
    "plan_node",
    "select_gpus",
]

MiB = 1 << 20
GiB = 1 << 30
KINDS = ("prefill", "decode")
RESERVE_FRACTION = 0.10  # of a GPU's memory, kept back (DESIGN.md, "Memory": ~10%)
RESERVE_MIN_BYTES = 1 * GiB  # per instance on a GPU: its CUDA context and activations
WEIGHTS_MARGIN_BYTES = 64 * MiB  # the arena's alignment slack
KV_MIN_BYTES = 1 * GiB
KV_ALIGN_BYTES = 64 * MiB  # a multiple of any slab size up to 64 MiB
HOST_FRACTION = 0.5  # of MemAvailable
SHM_FRACTION = 0.9  # of /dev/shm's free space
CPU_KV_FRACTION = 0.25  # of the host budget
CPU_KV_MIN_BYTES = 1 * GiB
CPU_KV_MAX_BYTES = 64 * GiB
MODEL_MARGIN_BYTES = 16 * MiB  # per model in the Model Cache (page rounding)
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
        start = START_BASE_S + min(self.cache.models_bytes, self.cache.model_cache_bytes) / (
            DISK_BYTES_PER_S)
        return ContainerPlan(shm, int(-(-start // 10) * 10))

    def describe(self) -> str:
        """What was chosen and why, a line each (printed at start, kept in the run dir)."""
        lines = [f"GPU plan (--gpus {self.spec}):" if self.spec else "Memory plan:"]
        by_gpu: dict[int, list[InstancePlan]] = {}
        by_name: dict[int, list[str]] = {}
        gpus: dict[int, GpuInfo] = {}
        for inst in self.instances:
            for rank, gpu in enumerate(inst.gpus):
                gpus[gpu.index] = gpu
                name = inst.name + (f" rank {rank}" if self.tp > 1 else "")
                by_gpu.setdefault(gpu.index, []).append(inst)
                by_name.setdefault(gpu.index, []).append(name)
        for index, placed in by_gpu.items():
            gpu = gpus[index]
            names = ", ".join(by_name[index])
            lines.append(f"  {gpu.device} {gpu.name}: {_gib(gpu.free_bytes)} free of "
                         f"{_gib(gpu.total_bytes)}, {_gib(gpu_reserve_bytes(gpu, len(placed)))} "
                         f"kept back -> {names}")  # fmt: skip
        for gpu in self.unused:
            lines.append(f"  {gpu.device} {gpu.name}: unused (more GPUs than instances)")
        for k in self.kinds:
            twice = "twice: active + prefetched" if k.prefetch_room else "once: no room to prefetch"
            model = f"{self.largest_model}, {_gib(self.largest_bytes)} in {self.dtype}"
            if k.tp > 1:
                lines.append(
                    f"  {k.kind} x{k.instances} (tensor parallel, {k.tp} GPUs each): device "
                    f"memory {_gib(k.device_memory_bytes)} per GPU = weights "
                    f"{_gib(k.weights_bytes)} (the largest model's shard, {model} split "
                    f"{k.tp} ways, {twice}) + KV {_gib(k.kv_memory_bytes)}"
                )
            else:
                lines.append(
                    f"  {k.kind} x{k.instances}: device memory {_gib(k.device_memory_bytes)} "
                    f"each = weights {_gib(k.weights_bytes)} (the largest model, {model}, "
                    f"{twice}) + KV {_gib(k.kv_memory_bytes)}"
                )
        if self.tp > 1 and self.unsharded:
            lines.append(f"  whole on a group's first GPU (they do not split {self.tp} ways): "
                         f"{', '.join(self.unsharded)}")  # fmt: skip
        cache, host = self.cache, self.host
        if cache is not None and host is not None:
            shm = (f", /dev/shm {_gib(host.shm_free_bytes)} free"
                   if host.shm_free_bytes is not None else "")  # fmt: skip
            lines.append(f"  host: MemAvailable {_gib(host.mem_available_bytes)}{shm} -> budget "
                         f"{_gib(cache.budget_bytes)} (half of MemAvailable, at most 90% of "
                         f"/dev/shm)")  # fmt: skip
            held = ("every model" if cache.holds_all else
                    f"capped: the models need {_gib(cache.models_bytes)}; the rest load from "
                    "disk on demand, least recently used evicted")  # fmt: skip
            lines.append(
                f"  Model Cache {_gib(cache.model_cache_bytes)} ({held}); CPU KV cache "
                f"{_gib(cache.kv_cache_bytes)} (a quarter of the budget, 1-64 GiB)"
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


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB"


# ---- the spec and the GPUs -------------------------------------------------------------------
def parse_gpus(spec: str) -> tuple[int, ...] | None:
    """``all`` -> None (every GPU); ``0,2`` -> (0, 2). PlacementError on anything else."""
    text = spec.strip()
    if text.lower() == "all":
        return None
    if not text:
        raise PlacementError("--gpus: empty (give `all` or CUDA indices like 0,1)")
    indices: list[int] = []
    for part in text.split(","):
        item = part.strip()
        if not item.lstrip("-").isdigit():
            raise PlacementError(f"--gpus {spec}: {item!r} is not a GPU index (`all` or 0,1,...)")
        index = int(item)
        if index < 0:
            raise PlacementError(f"--gpus {spec}: {index} is negative")
        if index in indices:
            raise PlacementError(f"--gpus {spec}: GPU {index} is listed twice")
        indices.append(index)
    return tuple(indices)


def select_gpus(spec: str, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The GPUs ``spec`` names among ``gpus`` (the machine's), in the spec's order."""
    wanted = parse_gpus(spec)
    if not gpus:
        raise PlacementError(f"--gpus {spec}: no CUDA GPU on this machine")
    if wanted is None:
        return list(gpus)
    by_index = {g.index: g for g in gpus}
    missing = [i for i in wanted if i not in by_index]
    if missing:
        have = ", ".join(str(g.index) for g in gpus)
        raise PlacementError(f"--gpus {spec}: GPU {missing[0]} is not on this machine "
                             f"(it has {have})")  # fmt: skip
    return [by_index[i] for i in wanted]


def assumed_gpus(spec: str, parse_size: Callable[[str], int]) -> list[GpuInfo]:
    """GPUs that are not here, for a plan made elsewhere (``--assume-gpus``): ``8x80GB``,
    ``24GB``, ``40GiB,40GiB`` (``parse_size`` reads a size); each one idle (free = total)."""
    out: list[GpuInfo] = []
    for part in spec.split(","):
        count_text, x, size_text = part.strip().lower().rpartition("x")
        if not x:
            count_text, size_text = "1", part.strip()
        try:
            count = int(count_text)
            size = parse_size(size_text.strip())
        except ValueError:
            raise PlacementError(f"--assume-gpus {spec}: {part.strip()!r} is not N x SIZE or "
                                 "SIZE (like 8x80GB, 24GB, 40GiB,40GiB)") from None  # fmt: skip
        if count < 1 or size < 2 * GiB:
            raise PlacementError(f"--assume-gpus {spec}: {part.strip()!r} needs at least one "
                                 "GPU of at least 2 GiB")  # fmt: skip
        for _ in range(count):
            label = size_text.strip().upper().replace("GIB", "GiB")
            out.append(GpuInfo(len(out), f"assumed {label} GPU", size, size))
    return out


def default_counts(num_gpus: int, prefill: int | None, decode: int | None) -> tuple[int, int]:
    """Instance counts: the config's where it gives them; else half of the GPUs (of the
    tensor-parallel groups) prefill and the rest decode, at least one of each."""
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


# ---- sizes ----------------------------------------------------------------------------------
def _largest(models: Mapping[str, int]) -> tuple[str, int]:
    if not models:
        raise PlacementError("no models to size for")
    name = max(models, key=lambda n: (models[n], n))
    return name, models[name]


def _share(gpu: GpuInfo, instances: Sequence[InstancePlan]) -> int:
    on = sum(1 for i in instances for g in i.gpus if g.index == gpu.index)
    return max(0, gpu.free_bytes - gpu_reserve_bytes(gpu, on)) // on


def _kind_plan(kind: str, placed: list[InstancePlan], everyone: list[InstancePlan],
               largest: tuple[str, int], dtype: str, tp: int = 1,
               whole: tuple[str, int] | None = None) -> KindPlan:  # fmt: skip
    """``whole``: the largest model at one GPU (its name and bytes) when ``largest`` is a
    shard (said in the error)."""
    shares = [(_share(g, everyone), i, g) for i in placed for g in i.gpus]
    share, tightest, gpu = min(shares, key=lambda s: s[0])
    device_memory = share // MiB * MiB
    name, model_bytes = largest
    once = -(-(model_bytes + WEIGHTS_MARGIN_BYTES) // MiB) * MiB
    twice = -(-(2 * model_bytes + WEIGHTS_MARGIN_BYTES) // MiB) * MiB
    if device_memory - twice >= max(KV_MIN_BYTES, device_memory // 4):
        weights, room = twice, True
    elif device_memory - once >= KV_MIN_BYTES:
        weights, room = once, False
    else:
        on = sum(1 for i in everyone for g in i.gpus if g.index == gpu.index)
        shared = f", shared by {on} instances" if on > 1 else ""
        what = (f"model {name} ({_gib(model_bytes)} in {dtype})" if tp == 1 or whole is None
                else f"model {name} ({_gib(whole[1])} in {dtype}, {_gib(model_bytes)} per GPU "
                f"split {tp} ways)")  # fmt: skip
        raise PlacementError(
            f"{what} does not fit {tightest.name} on "
            f"{gpu.device} ({gpu.name}): {_gib(gpu.free_bytes)} free of {_gib(gpu.total_bytes)}"
            f", {_gib(gpu_reserve_bytes(gpu, on))} kept back{shared} leaves "
            f"{_gib(device_memory)}; it needs {_gib(once + KV_MIN_BYTES)} (the weights and "
            f"1 GiB of KV). Free the GPU, give it fewer instances, or serve smaller models"
        )
    kv = (device_memory - weights) // KV_ALIGN_BYTES * KV_ALIGN_BYTES
    devices = tuple(g.device for i in placed for g in i.gpus)
    return KindPlan(kind, devices, weights + kv, kv, weights, room, tp)


def plan_instances(gpus: Sequence[GpuInfo], prefill: int, decode: int,
                   models: Mapping[str, int], dtype: str, tp: int = 1,
                   shard_bytes: Mapping[str, int] | None = None) -> Plan:  # fmt: skip
    """Place ``prefill`` + ``decode`` instances (groups of ``tp`` GPUs) on ``gpus`` and
    size each kind; ``shard_bytes``: each model's bytes per GPU at ``tp`` (default:
    ``models``, no sharding)."""
    instances = place(gpus, prefill, decode, tp)
    per_gpu = dict(shard_bytes) if shard_bytes is not None else dict(models)
    largest = _largest(per_gpu)
    whole = (largest[0], models.get(largest[0], largest[1]))
    kinds = tuple(
        _kind_plan(kind, [i for i in instances if i.kind == kind], instances, largest, dtype,
                   tp, whole)
        for kind in KINDS if any(i.kind == kind for i in instances)
    )  # fmt: skip
    used = {g.index for i in instances for g in i.gpus}
    name, nbytes = _largest(models)
    unsharded = tuple(sorted(m for m in models if tp > 1 and per_gpu.get(m) == models[m]))
    return Plan(spec=None, instances=tuple(instances), kinds=kinds,
                unused=tuple(g for g in gpus if g.index not in used),
                largest_model=name, largest_bytes=nbytes, dtype=dtype, tp=tp,
                unsharded=unsharded)  # fmt: skip


def _per_gpu(shards: Mapping[int, Mapping[str, TPSizes]], tp: int) -> dict[str, int] | None:
    return {m: s.per_gpu for m, s in shards[tp].items()} if tp > 1 and tp in shards else None


def choose_tp(gpus: Sequence[GpuInfo], counts: tuple[int | None, int | None],
              models: Mapping[str, int], dtype: str,
              shards: Mapping[int, Mapping[str, TPSizes]]) -> Plan:  # fmt: skip
    """The plan at the smallest tensor-parallel size (1, 2, 4, ...: the sizes ``shards``
    gives, at most the GPUs) whose largest shard fits; the size-1 error when none does,
    saying which sizes were tried."""
    sizes = sorted(t for t in {1, *shards} if t <= len(gpus))
    first: PlacementError | None = None
    for tp in sizes:
        prefill, decode = default_counts(max(1, len(gpus) // tp), *counts)
        try:
            return plan_instances(gpus, prefill, decode, models, dtype, tp,
                                  _per_gpu(shards, tp))  # fmt: skip
        except PlacementError as exc:
            first = first or exc
    assert first is not None
    tried = [t for t in sizes if t > 1]
    if tried:
        raise PlacementError(f"{first}; tensor parallelism over {', '.join(map(str, tried))} "
                             "GPUs does not fit either (more GPUs, or --tp with "
                             "fewer instances)") from None  # fmt: skip
    raise first


def plan_cache(host: HostInfo, models: Mapping[str, int], dtype: str) -> CachePlan:
    """The Model Cache and the CPU KV cache from the host's memory (module docstring)."""
    budget = int(host.mem_available_bytes * HOST_FRACTION)
    if host.shm_free_bytes is not None:
        budget = min(budget, int(host.shm_free_bytes * SHM_FRACTION))
    name, largest = _largest(models)
    need = -(-(sum(models.values()) + MODEL_MARGIN_BYTES * len(models)) // MiB) * MiB
    floor = largest + MODEL_MARGIN_BYTES
    kv = min(max(int(budget * CPU_KV_FRACTION), CPU_KV_MIN_BYTES), CPU_KV_MAX_BYTES)
    if budget - kv < floor:  # the KV cache gives way down to its minimum first
        kv = CPU_KV_MIN_BYTES
    if budget - kv < floor:
        shm = (f", /dev/shm {_gib(host.shm_free_bytes)} free"
               if host.shm_free_bytes is not None else "")  # fmt: skip
        raise PlacementError(
            f"host memory: MemAvailable {_gib(host.mem_available_bytes)}{shm} gives a budget of "
            f"{_gib(budget)}, too small for the largest model {name} ({_gib(largest)} in "
            f"{dtype}) beside a {_gib(kv)} CPU KV cache"
        )
    kv = kv // MiB * MiB
    model_cache = min(need, (budget - kv) // MiB * MiB)
    return CachePlan(model_cache, kv, budget, need, model_cache >= need)


def plan_node(spec: str | None, gpus: Sequence[GpuInfo], host: HostInfo | None,
              counts: tuple[int | None, int | None], models: Mapping[str, int],
              dtype: str, tp: int | None = None,
              shards: Mapping[int, Mapping[str, TPSizes]] | None = None) -> Plan:  # fmt: skip
    """The whole plan: instances on the GPUs ``spec`` selects (None: no instances
    planned) and, given ``host``, the cachemgr's sizes. ``tp``: the tensor-parallel size
    (None: the smallest that fits, of the sizes ``shards`` gives per model; 1 without)."""
    plan = Plan(spec=spec)
    if spec is not None:
        chosen = select_gpus(spec, gpus)
        shards = shards or {}
        if tp is None:
            plan = replace(choose_tp(chosen, counts, models, dtype, shards), spec=spec)
        else:
            if tp > 1 and tp not in shards:
                raise PlacementError(f"tensor parallelism {tp}: no shard sizes for it")
            groups = len(chosen) // tp
            if groups < 1:
                raise PlacementError(f"--gpus {spec}: {len(chosen)} GPU(s), tensor "
                                     f"parallelism {tp} needs {tp} per instance")  # fmt: skip
            prefill, decode = default_counts(groups, *counts)
            plan = replace(plan_instances(chosen, prefill, decode, models, dtype, tp,
                                          _per_gpu(shards, tp)), spec=spec)
    if host is None:
        return plan
    name, largest = _largest(models)
    # the Model Cache holds a sharded model as its shards back to back
    cached = ({m: s.cached for m, s in shards[plan.tp].items()} if shards and plan.tp > 1
              else models)  # fmt: skip
    return replace(
        plan,
        cache=plan_cache(host, cached, dtype),
        host=host,
        largest_model=name,
        largest_bytes=largest,
        dtype=dtype,
    )


# ---- the config it makes --------------------------------------------------------------------
_SIZE_KEYS = {
    "prefill": ("device", "devices", "device_memory", "device_memory_bytes", "kv_memory",
                "kv_memory_bytes", "instances", "tp"),
    "cachemgr": ("model_cache", "model_cache_bytes", "kv_cache", "kv_cache_bytes"),
}  # fmt: skip


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    section = raw.get(key) or {}
    return {k: v for k, v in section.items() if k not in _SIZE_KEYS.get(key, _SIZE_KEYS["prefill"])}


def apply_plan(raw: dict[str, Any], plan: Plan, unified: bool = False) -> dict[str, Any]:
    """``raw`` (a deployment as plain data) with the plan's devices, counts and sizes
    in place of the config's; sections the plan did not size are left as they are.

    ``unified`` (the request-level policies): every worker is a decode instance,
    prefill's first, so the decode section takes every planned device and the
    smaller of the two kinds' sizes.
    """
    out = dict(raw)
    kinds = [k for k in (plan.kind("prefill"), plan.kind("decode")) if k is not None]
    for k in kinds:
        out[k.kind] = {
            **_section(raw, k.kind),
            "instances": k.instances,
            "device": k.devices[0],
            "devices": list(k.devices),
            "device_memory": k.device_memory_bytes,
            "kv_memory": k.kv_memory_bytes,
            **({"tp": k.tp} if k.tp > 1 else {}),
        }
    if unified and len(kinds) == 2:
        decode = dict(out["decode"])
        decode["devices"] = [*kinds[0].devices, *kinds[1].devices]
        decode["device_memory"] = min(k.device_memory_bytes for k in kinds)
        decode["kv_memory"] = min(k.kv_memory_bytes for k in kinds)
        out["decode"] = decode
    if plan.cache is not None:
        out["cachemgr"] = {**_section(raw, "cachemgr"),
                           "model_cache": plan.cache.model_cache_bytes,
                           "kv_cache": plan.cache.kv_cache_bytes}  # fmt: skip
    return out
