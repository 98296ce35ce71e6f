"""The machine's facts for ``--gpus`` (``aegaeon_sched.placement`` decides from them).

- GPUs: ``torch.cuda`` (``mem_get_info`` per device), asked in a child process
  (``python -m aegaeon_cli.machine``) so the supervisor holds no CUDA context on
  any GPU afterwards; indices are CUDA's (``CUDA_VISIBLE_DEVICES`` applies).
- Host: ``MemAvailable`` from /proc/meminfo and /dev/shm's free space.
- Models: each model's packed weight bytes in the serving dtype, from its
  ``config.json`` (``aegaeon_engine.weight_layout``, what the Model Cache and
  the arena hold; no tensor is read, torch is not imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aegaeon_common.config import Config, ConfigError, InstancesConfig, config_from_dict
from aegaeon_common.config_parse import parse_bytes
from aegaeon_runtime.preflight import CudaDevices, no_driver
from aegaeon_sched.gpu_spec import parse_gpus, select_gpus
from aegaeon_sched.placement import (
    GpuInfo,
    HostInfo,
    PlacementError,
    Plan,
    TPSizes,
)
from aegaeon_sched.plan_config import apply_plan
from aegaeon_sched.sizing import cap_split, plan_node

PROBE_TIMEOUT_S = 120.0
GiB = 1 << 30
MiB = 1 << 20
ONLY = ("prefill", "decode", "instances", "cachemgr")


def cuda_devices() -> CudaDevices:
    """How many CUDA devices a service started here would see (the preflight check's
    answer, ``aegaeon_runtime.preflight``): none at once without a driver, else what
    the probe's torch says."""
    none = no_driver()
    if none is not None:
        return none
    try:
        return CudaDevices(len(cuda_gpus()))
    except PlacementError as exc:
        return CudaDevices(0, str(exc).removeprefix("--gpus: ").partition("; run without")[0])


def cuda_gpus() -> list[GpuInfo]:
    """Every CUDA device torch sees, with its free memory now; PlacementError (one
    line) when torch has no CUDA device."""
    try:
        done = subprocess.run([sys.executable, "-m", "aegaeon_cli.machine"], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise PlacementError(f"--gpus: asking torch.cuda for the GPUs took over "
                             f"{PROBE_TIMEOUT_S:g} s") from None  # fmt: skip
    lines = done.stdout.strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PlacementError(f"--gpus: the GPU probe failed ({tail})") from None
    if answer.get("error"):
        raise PlacementError(f"--gpus: {answer['error']}")
    return [GpuInfo(int(g["index"]), str(g["name"]), int(g["total"]), int(g["free"]))
            for g in answer["gpus"]]  # fmt: skip


def _probe() -> dict[str, Any]:
    """This process's view of the GPUs (run as the child of :func:`cuda_gpus`)."""
    try:
        import torch
    except ImportError:
        return {"error": "torch is not installed"}
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = f"CUDA {build} build, no device or driver" if build else "a CPU-only build"
        return {"error": f"no CUDA GPU visible to torch {torch.__version__} ({why}); "
                "run without --gpus to serve on the CPU"}  # fmt: skip
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append({"index": index, "name": torch.cuda.get_device_name(index),
                     "total": int(total), "free": int(free)})  # fmt: skip
    return {"gpus": gpus}


def host_info(meminfo: Path = Path("/proc/meminfo"), shm: Path = Path("/dev/shm")) -> HostInfo:
    """MemAvailable and /dev/shm's free bytes (None where there is no /dev/shm)."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                available = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        available = None
    if available is None:
        raise PlacementError(f"--gpus: no MemAvailable in {meminfo}")
    try:
        stat = os.statvfs(shm)
        shm_free: int | None = stat.f_bavail * stat.f_frsize
    except OSError:
        shm_free = None
    return HostInfo(available, shm_free)


def _weights(config: Config) -> tuple[dict[str, Any], dict[str, int]]:
    """Each model's spec, and each LoRA adapter's bytes: its own A and B, checked against
    its base (what the Model Cache holds of it; held whole, never sharded)."""
    from aegaeon_engine import CheckpointError, ModelSpec
    from aegaeon_engine.lora_spec import AdapterSpec, adapter_layout

    specs: dict[str, Any] = {}
    adapters: dict[str, int] = {}
    for model in sorted(config.models, key=lambda m: m.base is not None):  # bases first
        try:
            if model.base is None:
                specs[model.name] = ModelSpec.from_dir(model.path)
            else:
                adapter = AdapterSpec.from_dir(model.path, specs[model.base], model.name)
                adapters[model.name] = adapter_layout(adapter, config.dtype).total_bytes
        except CheckpointError as exc:
            raise PlacementError(f"model {model.name}: {exc}") from None
    return specs, adapters


def model_bytes(config: Config) -> dict[str, int]:
    """Each model's weight bytes in the deployment's dtype (its packed layout); a LoRA
    adapter's are its own A and B."""
    from aegaeon_engine import weight_layout

    specs, adapters = _weights(config)
    return {**{name: weight_layout(spec, config.dtype).total_bytes
               for name, spec in specs.items()},
            **adapters}  # fmt: skip


def shard_bytes(config: Config, sizes: list[int]) -> dict[int, dict[str, TPSizes]]:
    """Per tensor-parallel size, each model's bytes on the GPU that holds the most of it
    (its largest shard, or all of it where it does not split that many ways: it then
    runs whole on its group's first GPU) and in the Model Cache (every shard)."""
    from aegaeon_engine import weight_layout
    from aegaeon_engine.tp_layout import sharded_layout

    specs, adapters = _weights(config)
    out: dict[int, dict[str, TPSizes]] = {}
    for size in sizes:
        per: dict[str, TPSizes] = {name: TPSizes(n, n) for name, n in adapters.items()}
        for name, spec in specs.items():
            layout = sharded_layout(spec, size, config.dtype)
            if layout is None:
                whole = weight_layout(spec, config.dtype).total_bytes
                per[name] = TPSizes(whole, whole)
            else:
                per[name] = TPSizes(max(s.total_bytes for s in layout.shards),
                                    layout.total_bytes)  # fmt: skip
        out[size] = per
    return out


@dataclass(frozen=True)
class Assumed:
    """Facts given instead of asked (a plan for another machine, or a container's view):
    GPUs that are not here (``--assume-gpus``), MemAvailable (``--assume-memory``), the
    /dev/shm the cachemgr will have (``--shm-size``)."""

    gpus: tuple[GpuInfo, ...] | None = None
    mem_available_bytes: int | None = None
    shm_bytes: int | None = None

    def host(self) -> HostInfo:
        """The host as given, what is not given read from this machine."""
        if self.mem_available_bytes is not None and self.shm_bytes is not None:
            return HostInfo(self.mem_available_bytes, self.shm_bytes)
        real = host_info()
        available = (self.mem_available_bytes if self.mem_available_bytes is not None
                     else real.mem_available_bytes)  # fmt: skip
        shm = self.shm_bytes if self.shm_bytes is not None else real.shm_free_bytes
        return HostInfo(available, shm)


def plan_machine(config: Config, spec: str | None, counts: tuple[int | None, int | None],
                 only: str | None = None, tp: int | None = None,
                 assumed: Assumed | None = None,
                 cap_bytes: int | None = None) -> Plan:  # fmt: skip
    """The plan for this machine: instances on the GPUs ``spec`` names and the
    cachemgr's sizes. ``only`` (a container runs one service): ``prefill`` /
    ``decode``, that kind's instances alone on the GPUs this process sees;
    ``instances``, both kinds without the host; ``cachemgr``, the host alone.
    ``tp``: the tensor-parallel size (None: the smallest that fits)."""
    assumed = assumed or Assumed()
    if only is not None and only not in ONLY:
        raise PlacementError(f"--only {only}: one of {', '.join(ONLY)}")
    if spec is not None:
        parse_gpus(spec)  # a bad spec fails before the GPUs are asked
    models = model_bytes(config)
    if only == "cachemgr":
        return plan_node(None, [], assumed.host(), counts, models, config.dtype)
    gpus = list(assumed.gpus) if assumed.gpus is not None else cuda_gpus()
    most = len(select_gpus(spec, gpus)) if spec is not None else 1
    sizes = [tp] if tp is not None and tp > 1 else [
        2**k for k in range(1, 8) if 2**k <= most and tp is None]  # fmt: skip
    shards = shard_bytes(config, sizes)
    if only == "prefill":
        counts = (counts[0] or 1, 0)
    elif only == "decode":
        counts = (0, counts[1] or 1)
    host = assumed.host() if only is None else None
    return plan_node(spec, gpus, host, counts, models, config.dtype, cap_bytes, tp, shards)


def explicit_counts(raw: dict[str, Any]) -> tuple[int | None, int | None]:
    """The instance counts a deployment file gives (None: the plan chooses)."""
    found: list[int | None] = []
    for kind in ("prefill", "decode"):
        value = (raw.get(kind) or {}).get("instances")
        found.append(None if value is None else int(value))
    return found[0], found[1]


def explicit_tp(raw: dict[str, Any]) -> int | None:
    """The tensor-parallel size a deployment file gives (None: the plan chooses)."""
    for kind in ("prefill", "decode"):
        value = (raw.get(kind) or {}).get("tp")
        if value is not None:
            return int(value)
    return None


def sized(raw: dict[str, Any], config: Config, spec: str | None,
          counts: tuple[int | None, int | None], only: str | None = None,
          base: Path | None = None, assumed: Assumed | None = None,
          cap_bytes: int | None = None) -> tuple[Config, dict[str, Any], Plan]:  # fmt: skip
    """``raw`` planned for this machine: the config, its plain data and the plan (at
    the file's tensor-parallel size where it gives one; each instance's device memory
    at most ``cap_bytes``, ``--device-memory``). Raises PlacementError or ConfigError
    with a one-line message."""
    plan = plan_machine(config, spec, counts, only, explicit_tp(raw), assumed, cap_bytes)
    out = apply_plan(raw, plan, unified=config.unified)
    for kind in ("prefill", "decode"):
        if kind in out and "device_memory" in (out[kind] or {}):
            inst = config.prefill if kind == "prefill" else config.decode
            out[kind] = _reserve_adapters(out[kind], raw.get(kind) or {}, inst, config)
    try:
        return config_from_dict(out, source=config.source, base=base), out, plan
    except ConfigError as exc:  # a plan the config's own checks refuse: say both
        raise PlacementError(f"the planned config does not validate: {exc}") from None


def with_tp(raw: dict[str, Any], tp: int | None) -> dict[str, Any]:
    """``raw`` with every instance section at tensor-parallel size ``tp`` (None: as it is)."""
    if tp is None:
        return raw
    out = dict(raw)
    for kind in ("prefill", "decode"):
        out[kind] = {**(raw.get(kind) or {}), "tp": tp}
    return out


_BUFFER_KEYS = ("device_memory", "device_memory_bytes", "kv_memory", "kv_memory_bytes")


def capped(raw: dict[str, Any], config: Config, cap_bytes: int,
           base: Path | None = None) -> tuple[Config, dict[str, Any], list[str]]:  # fmt: skip
    """``raw`` with every instance's device memory capped at ``cap_bytes``
    (``--device-memory``): the weights arena and the KV region split inside it by
    ``aegaeon_sched.sizing.split_buffer``; on a CPU device ``weights: auto`` becomes
    ``copy`` (the instance holds its models in its own memory, as a GPU does). The
    config, its plain data and a line per kind saying what was chosen. PlacementError
    when the largest model does not fit."""
    models = model_bytes(config)
    out = dict(raw)
    lines = []
    for kind in ("prefill", "decode"):
        inst = config.prefill if kind == "prefill" else config.decode
        device = inst.device_of(0)
        split = cap_split(cap_bytes, models, config.dtype, device)
        section = {k: v for k, v in (raw.get(kind) or {}).items() if k not in _BUFFER_KEYS}
        section.update(device_memory=split.device_memory_bytes, kv_memory=split.kv_memory_bytes)
        if device.startswith("cpu") and inst.weights == "auto":
            section["weights"] = "copy"
        out[kind] = section = _reserve_adapters(section, raw.get(kind) or {}, inst, config)
        held = "two of the largest model" if split.prefetch_room else "the largest model once"
        lines.append(f"  {kind}: device memory {split.device_memory_bytes / GiB:.2f} GiB each = "
                     f"weights {split.weights_bytes / GiB:.2f} GiB ({held}) + KV "
                     f"{split.kv_memory_bytes / GiB:.2f} GiB on {device}")  # fmt: skip
    try:
        return config_from_dict(out, source=config.source, base=base), out, lines
    except ConfigError as exc:
        raise PlacementError(f"--device-memory: the capped config does not validate: "
                             f"{exc}") from None  # fmt: skip


def _reserve_adapters(section: dict[str, Any], raw: dict[str, Any], inst: InstancesConfig,
                      config: Config) -> dict[str, Any]:
    """A planned instance section of a deployment that serves LoRA adapters (or names an
    ``adapter_memory`` for run-time loads) on a device that copies weights: their region
    (its ``adapter_memory``, else 1/16 of the planned device memory) taken from the
    planned KV region, so the weights arena still
    holds what the plan sized it for. PlacementError when no KV would be left."""
    weights = section.get("weights", inst.weights)
    device = str(section.get("device", inst.device))
    copies = weights == "copy" or (weights == "auto" and not device.startswith("cpu"))
    given = raw.get("adapter_memory", raw.get("adapter_memory_bytes"))
    if not copies or (given is None and not any(m.base is not None for m in config.models)):
        return section
    device_memory, kv = int(section["device_memory"]), int(section["kv_memory"])
    region = parse_bytes(given) if given is not None else device_memory // 16 // MiB * MiB
    if kv - region < MiB:
        raise PlacementError(f"the LoRA adapters' region ({region / GiB:.2f} GiB, "
                             f"adapter_memory) leaves no KV region of the planned "
                             f"{kv / GiB:.2f} GiB on {device}; give a smaller adapter_memory "
                             "or more device memory")  # fmt: skip
    return {**section, "adapter_memory": region, "kv_memory": kv - region}


def with_absolute_paths(raw: dict[str, Any], config: Config) -> dict[str, Any]:
    """``raw`` with its market and model paths absolute (as ``config`` resolved them),
    for a file written somewhere else than the one it was read from."""
    out = {**raw, "market": str(config.market_dir) if config.market_dir else None}
    if raw.get("models"):
        out["models"] = [{"name": m.name, "path": str(m.path),
                          **({"base": m.base} if m.base else {})} for m in config.models]
    return out


def planned_yaml(raw: dict[str, Any], config: Config, plan: Plan | None) -> str:
    """The effective config as YAML (paths absolute, :func:`with_absolute_paths`), the plan
    (if any) as comment lines at its head."""
    head = "" if plan is None else "".join(f"# {line}\n" for line in plan.describe().splitlines())
    return head + yaml.safe_dump(with_absolute_paths(raw, config), sort_keys=False)


if __name__ == "__main__":
    print(json.dumps(_probe()), flush=True)
