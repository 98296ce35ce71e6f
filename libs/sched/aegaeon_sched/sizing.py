"""How much memory each planned instance and the cachemgr get (``--gpus``).

Pure, as :mod:`aegaeon_sched.placement` (which places the instances); the rules
(docs/gpu.md says the same):

- **Device memory.** Each GPU keeps back its reserve
  (:func:`~aegaeon_sched.placement.gpu_reserve_bytes`); the rest of its *free*
  memory is split evenly between its instances. The instances of a kind share
  one size (the config's sections are homogeneous): the smallest share among them.
- **KV region.** Device memory less the weights arena: twice the largest
  model plus a margin (active + prefetched) when that leaves at least a
  quarter of the device memory and 1 GiB for KV, else once (no room to
  prefetch); a model that does not fit with 1 GiB of KV is an error naming it.
  ``--device-memory`` caps each instance's device memory (with ``--gpus``: the
  smaller of the cap and its share of the GPU) and the same rule splits it (on
  a CPU device the least KV is 64 MiB).
- **Host.** The budget is half of MemAvailable, at most 90% of /dev/shm's free
  space (the Model Cache and the CPU KV cache live there). CPU KV cache: a
  quarter of the budget, between 1 and 64 GiB. Model Cache: every model of the
  deployment when the rest of the budget holds them, else the rest (the
  cache then evicts, least recently used); at least the largest model.
- **Tensor parallelism.** Given each model's bytes per GPU at each size
  (``shards``: a model whose heads do not split runs whole on its group's first
  GPU), a plan without a ``tp`` of its own takes the smallest size (1, 2, 4, 8,
  ...) whose largest shard fits a GPU's share with 1 GiB of KV; the Model Cache
  then holds each sharded model as its shards back to back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from aegaeon_sched.gpu_spec import select_gpus
from aegaeon_sched.placement import (
    CachePlan,
    GiB,
    GpuInfo,
    HostInfo,
    InstancePlan,
    KindPlan,
    MiB,
    PlacementError,
    Plan,
    TPSizes,
    default_counts,
    gpu_reserve_bytes,
    in_gib,
    place,
)

__all__ = [
    "KV_MIN_BYTES",
    "BufferSplit",
    "cap_split",
    "choose_tp",
    "plan_cache",
    "plan_instances",
    "plan_node",
    "split_buffer",
]

KINDS = ("prefill", "decode")
WEIGHTS_MARGIN_BYTES = 64 * MiB  # the arena's alignment slack
KV_MIN_BYTES = 1 * GiB
CPU_KV_REGION_MIN_BYTES = 64 * MiB  # an instance on a CPU (--device-memory there)
KV_ALIGN_BYTES = 64 * MiB  # a multiple of any slab size up to 64 MiB
HOST_FRACTION = 0.5  # of MemAvailable
SHM_FRACTION = 0.9  # of /dev/shm's free space
CPU_KV_FRACTION = 0.25  # of the host budget
CPU_KV_MIN_BYTES = 1 * GiB
CPU_KV_MAX_BYTES = 64 * GiB
MODEL_MARGIN_BYTES = 16 * MiB  # per model in the Model Cache (page rounding)


# ---- sizes ----------------------------------------------------------------------------------
def _largest(models: Mapping[str, int]) -> tuple[str, int]:
    if not models:
        raise PlacementError("no models to size for")
    name = max(models, key=lambda n: (models[n], n))
    return name, models[name]


@dataclass(frozen=True)
class BufferSplit:
    """One instance's buffer (its device memory) split into weights arena and KV region."""

    device_memory_bytes: int
    weights_bytes: int
    kv_memory_bytes: int
    prefetch_room: bool  # the arena holds two of the largest model


def kv_min_bytes(device: str) -> int:
    """The least KV region an instance on ``device`` is given: 1 GiB on a GPU, 64 MiB on
    a CPU (whose models are small)."""
    return KV_MIN_BYTES if device.startswith("cuda") else CPU_KV_REGION_MIN_BYTES


def split_buffer(device_memory_bytes: int, model_bytes: int,
                 kv_min: int = KV_MIN_BYTES) -> BufferSplit | None:  # fmt: skip
    """The rule (module docstring, "KV region"): the weights arena holds the largest model
    twice (active + prefetched) when that leaves at least a quarter of the device memory
    and ``kv_min`` for KV, else once; the rest is KV (in whole 64 MiB, or MiB under
    1 GiB). None when the model and ``kv_min`` of KV do not fit."""
    device_memory = device_memory_bytes // MiB * MiB
    once = -(-(model_bytes + WEIGHTS_MARGIN_BYTES) // MiB) * MiB
    twice = -(-(2 * model_bytes + WEIGHTS_MARGIN_BYTES) // MiB) * MiB
    if device_memory - twice >= max(kv_min, device_memory // 4):
        weights, room = twice, True
    elif device_memory - once >= kv_min:
        weights, room = once, False
    else:
        return None
    align = KV_ALIGN_BYTES if device_memory - weights >= GiB else MiB
    kv = (device_memory - weights) // align * align
    return BufferSplit(weights + kv, weights, kv, room)


def cap_split(cap_bytes: int, models: Mapping[str, int], dtype: str, device: str,
              flag: str = "--device-memory") -> BufferSplit:  # fmt: skip
    """An instance capped at ``cap_bytes`` on ``device``: its split, or a PlacementError
    naming the flag, the largest model and what it needs."""
    name, largest = _largest(models)
    kv_min = kv_min_bytes(device)
    split = split_buffer(cap_bytes, largest, kv_min)
    if split is None:
        need = -(-(largest + WEIGHTS_MARGIN_BYTES) // MiB) * MiB + kv_min
        raise PlacementError(
            f"{flag} {in_gib(cap_bytes)}: the largest model {name} ({in_gib(largest)} in "
            f"{dtype}) and {kv_min // MiB} MiB of KV need {in_gib(need)} per instance on "
            f"{device}; give more device memory or serve smaller models")  # fmt: skip
    return split


def _share(gpu: GpuInfo, instances: Sequence[InstancePlan]) -> int:
    on = sum(1 for i in instances for g in i.gpus if g.index == gpu.index)
    return max(0, gpu.free_bytes - gpu_reserve_bytes(gpu, on)) // on


def _kind_plan(kind: str, placed: list[InstancePlan], everyone: list[InstancePlan],
               largest: tuple[str, int], dtype: str, cap_bytes: int | None = None,
               tp: int = 1, whole: tuple[str, int] | None = None) -> KindPlan:  # fmt: skip
    """``largest``: the most bytes of a model on one GPU (a shard with ``tp`` > 1;
    ``whole``: that model's name and bytes, said in the error)."""
    shares = [(_share(g, everyone), i, g) for i in placed for g in i.gpus]
    share, tightest, gpu = min(shares, key=lambda s: s[0])
    if cap_bytes is not None:
        share = min(share, cap_bytes)  # --device-memory caps what the GPU would give
    device_memory = share // MiB * MiB
    name, model_bytes = largest
    split = split_buffer(device_memory, model_bytes)
    if split is None:
        once = -(-(model_bytes + WEIGHTS_MARGIN_BYTES) // MiB) * MiB
        on = sum(1 for i in everyone for g in i.gpus if g.index == gpu.index)
        shared = f", shared by {on} instances" if on > 1 else ""
        what = (f"model {name} ({in_gib(model_bytes)} in {dtype})" if tp == 1 or whole is None
                else f"model {name} ({in_gib(whole[1])} in {dtype}, {in_gib(model_bytes)} per "
                f"GPU split {tp} ways)")  # fmt: skip
        raise PlacementError(
            f"{what} does not fit {tightest.name} on "
            f"{gpu.device} ({gpu.name}): {in_gib(gpu.free_bytes)} free of {in_gib(gpu.total_bytes)}"
            f", {in_gib(gpu_reserve_bytes(gpu, on))} kept back{shared} leaves "
            f"{in_gib(device_memory)}; it needs {in_gib(once + KV_MIN_BYTES)} (the weights and "
            f"1 GiB of KV). Free the GPU, give it fewer instances, or serve smaller models"
            + (f" (--device-memory caps it at {in_gib(cap_bytes)})" if cap_bytes is not None
               else "")
        )
    devices = tuple(g.device for i in placed for g in i.gpus)
    return KindPlan(kind, devices, split.device_memory_bytes, split.kv_memory_bytes,
                    split.weights_bytes, split.prefetch_room, tp)  # fmt: skip


def plan_instances(gpus: Sequence[GpuInfo], prefill: int, decode: int,
                   models: Mapping[str, int], dtype: str, cap_bytes: int | None = None,
                   tp: int = 1, shard_bytes: Mapping[str, int] | None = None) -> Plan:  # fmt: skip
    """Place ``prefill`` + ``decode`` instances (groups of ``tp`` GPUs) on ``gpus`` and
    size each kind (each instance's device memory at most ``cap_bytes`` when given);
    ``shard_bytes``: each model's bytes per GPU at ``tp`` (default: ``models``)."""
    instances = place(gpus, prefill, decode, tp)
    per_gpu = dict(shard_bytes) if shard_bytes is not None else dict(models)
    largest = _largest(per_gpu)
    whole = (largest[0], models.get(largest[0], largest[1]))
    kinds = tuple(
        _kind_plan(kind, [i for i in instances if i.kind == kind], instances, largest, dtype,
                   cap_bytes, tp, whole)
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
              shards: Mapping[int, Mapping[str, TPSizes]],
              cap_bytes: int | None = None) -> Plan:  # fmt: skip
    """The plan at the smallest tensor-parallel size (1, 2, 4, ...: the sizes ``shards``
    gives, at most the GPUs) whose largest shard fits; the size-1 error when none does,
    saying which sizes were tried."""
    sizes = sorted(t for t in {1, *shards} if t <= len(gpus))
    first: PlacementError | None = None
    for tp in sizes:
        prefill, decode = default_counts(max(1, len(gpus) // tp), *counts)
        try:
            return plan_instances(gpus, prefill, decode, models, dtype, cap_bytes, tp,
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
        shm = (f", /dev/shm {in_gib(host.shm_free_bytes)} free"
               if host.shm_free_bytes is not None else "")  # fmt: skip
        raise PlacementError(
            f"host memory: MemAvailable {in_gib(host.mem_available_bytes)}{shm} gives a budget of "
            f"{in_gib(budget)}, too small for the largest model {name} ({in_gib(largest)} in "
            f"{dtype}) beside a {in_gib(kv)} CPU KV cache"
        )
    kv = kv // MiB * MiB
    model_cache = min(need, (budget - kv) // MiB * MiB)
    return CachePlan(model_cache, kv, budget, need, model_cache >= need)


def plan_node(spec: str | None, gpus: Sequence[GpuInfo], host: HostInfo | None,
              counts: tuple[int | None, int | None], models: Mapping[str, int],
              dtype: str, cap_bytes: int | None = None, tp: int | None = None,
              shards: Mapping[int, Mapping[str, TPSizes]] | None = None) -> Plan:  # fmt: skip
    """The whole plan: instances on the GPUs ``spec`` selects (None: no instances
    planned; each at most ``cap_bytes`` of device memory when given) and, given
    ``host``, the cachemgr's sizes. ``tp``: the tensor-parallel size (None: the
    smallest that fits, of the sizes ``shards`` gives per model; 1 without)."""
    plan = Plan(spec=spec)
    shards = shards or {}
    if spec is not None:
        chosen = select_gpus(spec, gpus)
        if tp is None:
            plan = replace(choose_tp(chosen, counts, models, dtype, shards, cap_bytes), spec=spec)
        else:
            if tp > 1 and tp not in shards:
                raise PlacementError(f"tensor parallelism {tp}: no shard sizes for it")
            if len(chosen) // tp < 1:
                raise PlacementError(f"--gpus {spec}: {len(chosen)} GPU(s), tensor "
                                     f"parallelism {tp} needs {tp} per instance")  # fmt: skip
            prefill, decode = default_counts(len(chosen) // tp, *counts)
            plan = replace(plan_instances(chosen, prefill, decode, models, dtype, cap_bytes, tp,
                                          _per_gpu(shards, tp)), spec=spec)  # fmt: skip
    if host is None:
        return plan
    name, largest = _largest(models)
    # the Model Cache holds a sharded model as its shards back to back
    cached = ({m: s.cached for m, s in shards[plan.tp].items()} if plan.tp > 1
              and plan.tp in shards else models)  # fmt: skip
    return replace(
        plan,
        cache=plan_cache(host, cached, dtype),
        host=host,
        largest_model=name,
        largest_bytes=largest,
        dtype=dtype,
    )
