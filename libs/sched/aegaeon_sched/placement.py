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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CachePlan",
    "GpuInfo",
    "HostInfo",
    "InstancePlan",
    "KindPlan",
    "PlacementError",
    "Plan",
    "default_counts",
    "gpu_reserve_bytes",
    "parse_gpus",
    "place",
    "select_gpus",
]

MiB = 1 << 20
GiB = 1 << 30
RESERVE_FRACTION = 0.10  # of a GPU's memory, kept back (docs/gpu.md: ~10%)
RESERVE_MIN_BYTES = 1 * GiB  # per instance on a GPU: its CUDA context and activations


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
class InstancePlan:
    """Instance ``index`` of ``kind`` on ``gpu``, which ``sharing`` instances share."""

    kind: str
    index: int
    gpu: GpuInfo
    sharing: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


@dataclass(frozen=True)
class KindPlan:
    """The sizes every instance of one kind gets (the config's sections are homogeneous)."""

    kind: str
    devices: tuple[str, ...]
    device_memory_bytes: int
    kv_memory_bytes: int
    weights_bytes: int
    prefetch_room: bool  # the arena holds two of the largest model


@dataclass(frozen=True)
class CachePlan:
    """The cachemgr's sizes and what they came from."""

    model_cache_bytes: int
    kv_cache_bytes: int
    budget_bytes: int
    models_bytes: int  # every model, as the Model Cache holds them
    holds_all: bool


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

    def kind(self, kind: str) -> KindPlan | None:
        return next((k for k in self.kinds if k.kind == kind), None)

    def describe(self) -> str:
        """What was chosen and why, a line each (printed at start, kept in the run dir)."""
        lines = [f"GPU plan (--gpus {self.spec}):" if self.spec else "Memory plan:"]
        by_gpu: dict[int, list[InstancePlan]] = {}
        for inst in self.instances:
            by_gpu.setdefault(inst.gpu.index, []).append(inst)
        for placed in by_gpu.values():
            gpu = placed[0].gpu
            names = ", ".join(i.name for i in placed)
            kept = gpu_reserve_bytes(gpu, len(placed))
            lines.append(f"  {gpu.device} {gpu.name}: {in_gib(gpu.free_bytes)} free of "
                         f"{in_gib(gpu.total_bytes)}, {in_gib(kept)} kept back -> "
                         f"{names}")  # fmt: skip
        for gpu in self.unused:
            lines.append(f"  {gpu.device} {gpu.name}: unused (more GPUs than instances)")
        for k in self.kinds:
            twice = "twice: active + prefetched" if k.prefetch_room else "once: no room to prefetch"
            model = f"{self.largest_model}, {in_gib(self.largest_bytes)} in {self.dtype}"
            lines.append(
                f"  {k.kind} x{len(k.devices)}: device memory {in_gib(k.device_memory_bytes)} each "
                f"= weights {in_gib(k.weights_bytes)} (the largest model, {model}, {twice}) "
                f"+ KV {in_gib(k.kv_memory_bytes)}"
            )
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
        return "\n".join(lines)


def in_gib(nbytes: int) -> str:
    """``nbytes`` as the plan's lines write it: ``12.3 GiB``."""
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


def place(gpus: Sequence[GpuInfo], prefill: int, decode: int) -> list[InstancePlan]:
    """Prefill instances, then decode instances, one per GPU in order, round and
    round when there are more instances than GPUs (those share a GPU)."""
    if not gpus:
        raise PlacementError("no GPU to place instances on")
    slots = [("prefill", i) for i in range(prefill)] + [("decode", j) for j in range(decode)]
    on = [gpus[n % len(gpus)] for n in range(len(slots))]
    sharing = {g.index: sum(1 for o in on if o.index == g.index) for g in gpus}
    return [InstancePlan(kind, index, gpu, sharing[gpu.index])
            for (kind, index), gpu in zip(slots, on, strict=True)]  # fmt: skip


def gpu_reserve_bytes(gpu: GpuInfo, instances: int) -> int:
    """What a GPU keeps back from its instances: 10% of it, at least 1 GiB each."""
    return max(int(gpu.total_bytes * RESERVE_FRACTION), RESERVE_MIN_BYTES * instances)
