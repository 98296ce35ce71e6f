"""The paper scenario's models: what the machine holds, which presets fit, and writing them.

``python -m aegaeon_bench.gpu_check.models --market DIR --device cuda:0 --json`` reads
the machine (host RAM from /proc/meminfo, free disk under the market, free
/dev/shm where the Model Cache lives, the GPU's free memory, the disk's write
rate measured with one fsync'd file), chooses the models (:func:`choose_models`,
pure), writes them as ``aegaeon market add --random`` does (real shapes,
random bf16 weights, in threads) and lays out the two instances that share the
device (:func:`instance_layout`). ``--tiny`` (the dry run): the same presets
shrunk to a few layers of width 128 (:func:`tiny_preset`), their real
vocabularies kept. The last stdout line is the JSON object.

The rule (issue 24): the weights sum to at most half the host RAM, 60% of the
free disk, what /dev/shm holds beside the host KV cache, and what the disk
writes in the build's time budget; every model fits the device beside its KV
region. The preferred mix (two 8B, two 3B, two 1.5B, a 1B, a 0.5B) is shrunk
by replacing the largest model with the next smaller preset until it fits, and
only when every model is the smallest preset by dropping models.

Standard library only at the top: the scenario's planner imports this module
before the carried wheels are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
# the example mix, then smaller models up to the most the scenario serves
PREFERRED = ("llama-3.1-8b", "qwen3-8b", "llama-3.2-3b", "llama-3.2-3b", "qwen2.5-1.5b",
             "qwen2.5-1.5b", "llama-3.2-1b", "qwen2.5-0.5b")  # fmt: skip
RAM_FRACTION = 0.5
DISK_FRACTION = 0.6
SHM_FRACTION = 0.9
# One device, two instances (prefill + decode, or two unified ones), each with an arena
# of two models (the active one and a prefetched one) and its KV region on top.
INSTANCES = 2
ARENA_MODELS = 2
ARENA_SLACK_BYTES = 64 * MiB
GPU_USABLE_FRACTION = 0.95
GPU_INSTANCE_MARGIN_BYTES = 3 * GiB  # CUDA context, activations, torch's cache
GPU_KV_MIN_BYTES = 2 * GiB
GPU_KV_MAX_BYTES = 16 * GiB
GPU_HOST_KV_BYTES = 4 * GiB  # cachemgr's unified KV cache, in /dev/shm
CPU_KV_BYTES = 128 * MiB
CPU_HOST_KV_BYTES = 256 * MiB
BYTES_PER_PARAM = 2  # bfloat16


@dataclass(frozen=True)
class MachineFacts:
    """What the machine reports (bytes; ``gpu_free_bytes`` None on a CPU)."""

    host_ram_bytes: int
    disk_free_bytes: int
    shm_free_bytes: int
    gpu_free_bytes: int | None
    write_bytes_per_s: float


@dataclass(frozen=True)
class ModelChoice:
    """:func:`choose_models`' answer and why."""

    presets: tuple[str, ...]
    total_bytes: int
    cap_bytes: int  # the smallest of ``caps``
    caps: dict[str, int]  # rule -> the bytes it allows
    binding: str  # the rule that sets ``cap_bytes``
    gpu_model_cap_bytes: int | None  # the largest model the device holds (None: no device)
    downgrades: int  # models replaced by a smaller preset
    dropped: int  # models left out


def gpu_model_cap(gpu_free_bytes: int | None) -> int | None:
    """The largest weights with which both instances' arenas and the least KV region fit
    the device (None: no device)."""
    if gpu_free_bytes is None:
        return None
    per_instance = GPU_USABLE_FRACTION * gpu_free_bytes / INSTANCES
    room = per_instance - GPU_INSTANCE_MARGIN_BYTES - ARENA_SLACK_BYTES - GPU_KV_MIN_BYTES
    return max(int(room // ARENA_MODELS), 0)


def host_kv_bytes(on_gpu: bool) -> int:
    return GPU_HOST_KV_BYTES if on_gpu else CPU_HOST_KV_BYTES


def choose_models(facts: MachineFacts, sizes: Mapping[str, int], build_budget_s: float, *,
                  preferred: Sequence[str] = PREFERRED, max_models: int = len(PREFERRED)
                  ) -> ModelChoice:
    """The presets to serve (``sizes``: preset -> weight bytes) under the module's rule."""
    caps = {
        "host_ram": int(RAM_FRACTION * facts.host_ram_bytes),
        "disk": int(DISK_FRACTION * facts.disk_free_bytes),
        "shm": int(SHM_FRACTION * facts.shm_free_bytes)
        - host_kv_bytes(facts.gpu_free_bytes is not None),
        "build_time": int(facts.write_bytes_per_s * build_budget_s),
    }  # fmt: skip
    binding = min(caps, key=lambda k: caps[k])
    cap = max(caps[binding], 0)
    device_cap = gpu_model_cap(facts.gpu_free_bytes)
    by_size = sorted(sizes, key=lambda p: (sizes[p], p))

    def smaller(preset: str) -> str | None:
        below = [p for p in by_size if sizes[p] < sizes[preset]]
        return below[-1] if below else None

    mix = [p for p in preferred[:max_models] if p in sizes]
    downgrades = dropped = 0
    while mix:
        too_big = [i for i, p in enumerate(mix) if device_cap is not None
                   and sizes[p] > device_cap]  # fmt: skip
        if not too_big and sum(sizes[p] for p in mix) <= cap:
            break
        # the largest model (the last of equals, so the mix stays varied) gets smaller
        i = too_big[-1] if too_big else max(range(len(mix)), key=lambda j: (sizes[mix[j]], j))
        down = smaller(mix[i])
        if down is not None:
            mix[i] = down
            downgrades += 1
        else:
            mix.pop(i if too_big else len(mix) - 1)
            dropped += 1
    return ModelChoice(tuple(mix), sum(sizes[p] for p in mix), cap, caps, binding, device_cap,
                       downgrades, dropped)  # fmt: skip


@dataclass(frozen=True)
class InstanceLayout:
    """Each instance's buffer on the device and the node's host-side caches."""

    device_memory_bytes: int  # arena (two of the largest model) + KV region
    kv_memory_bytes: int
    model_cache_bytes: int
    host_kv_cache_bytes: int


def instance_layout(weight_bytes: Sequence[int], gpu_free_bytes: int | None) -> InstanceLayout:
    """Two instances on one device: arenas of two of the largest model, the rest of the
    device (up to a cap) as each one's KV region; on a CPU a small KV region."""
    largest = max(weight_bytes)
    arena = ARENA_MODELS * largest + ARENA_SLACK_BYTES
    if gpu_free_bytes is None:
        kv = CPU_KV_BYTES
    else:
        per_instance = GPU_USABLE_FRACTION * gpu_free_bytes / INSTANCES
        kv = int(min(per_instance - GPU_INSTANCE_MARGIN_BYTES - arena, GPU_KV_MAX_BYTES))
        kv = max(kv // MiB * MiB, GPU_KV_MIN_BYTES)
    cache = sum(weight_bytes) + sum(weight_bytes) // 20 + 256 * MiB  # slack: alignment
    return InstanceLayout(arena + kv, kv, cache, host_kv_bytes(gpu_free_bytes is not None))


# ---- reading the machine ------------------------------------------------------------
def host_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo}: no MemTotal")


def shm_free_bytes(path: Path = Path("/dev/shm")) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def write_rate(folder: Path, nbytes: int) -> float:
    """Bytes/s of one file of ``nbytes`` written and fsync'd in ``folder`` (then removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".write-rate-{os.getpid()}"
    block = os.urandom(MiB)
    start = time.perf_counter()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(max(nbytes // MiB, 1)):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        return max(nbytes, MiB) / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def torch_version() -> dict[str, str | None]:
    import torch

    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda}


def gpu_memory(device: str) -> dict[str, Any] | None:
    """The device's name, total and free bytes (torch), None on a CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return {"name": torch.cuda.get_device_name(torch.device(device)), "total_bytes": int(total),
            "free_bytes": int(free)}  # fmt: skip


# ---- the presets ---------------------------------------------------------------------
def tiny_preset(preset: Any) -> Any:
    """``preset`` with two layers of width 128 (its family, vocabulary and config keys
    kept): the dry run's stand-in, a few MB of layers beside its real-size embeddings."""
    from dataclasses import replace

    recipe = replace(preset.recipe, hidden_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, intermediate_size=256)  # fmt: skip
    return replace(preset, recipe=recipe)


def presets(tiny: bool) -> dict[str, Any]:
    from aegaeon_market.presets import PRESETS

    return {name: tiny_preset(p) if tiny else p for name, p in PRESETS.items()}


def model_name(index: int, preset: str) -> str:
    return f"m{index}-{preset}"


def build(market: Path, chosen: Sequence[str], catalogue: Mapping[str, Any],
          threads: int = 4) -> list[dict[str, Any]]:
    """Write the chosen presets into ``market`` (in parallel); one row per model."""
    from concurrent.futures import ThreadPoolExecutor

    from aegaeon_market.edit import add_random

    def one(item: tuple[int, str]) -> dict[str, Any]:
        index, preset = item
        start = time.perf_counter()
        entry = add_random(market, catalogue[preset], model_name(index, preset),
                           progress=False, replace_existing=True)  # fmt: skip
        return {"name": entry.name, "preset": preset, "params": int(entry.params),
                "bytes": int(entry.params) * BYTES_PER_PARAM,
                "write_s": round(time.perf_counter() - start, 2)}  # fmt: skip

    items = list(enumerate(chosen))
    if not items:
        return []
    first = one(items[0])  # a new market is a folder holding one add's staging at a time
    with ThreadPoolExecutor(max_workers=max(min(threads, len(items) - 1), 1)) as pool:
        return [first, *pool.map(one, items[1:])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--market", type=Path, required=True, help="the market to write")
    parser.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    parser.add_argument("--max-models", type=int, default=len(PREFERRED))
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="seconds the writing may take at the measured disk rate (60)")
    parser.add_argument("--tiny", action="store_true", help="the presets shrunk (dry run)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    args = parser.parse_args(argv)
    market = args.market.resolve()
    market.parent.mkdir(parents=True, exist_ok=True)
    gpu = gpu_memory(args.device)
    catalogue = presets(args.tiny)
    import aegaeon_market.edit  # noqa: F401  (torch: imported before the build is timed)
    sizes = {name: p.params * BYTES_PER_PARAM for name, p in catalogue.items()}
    facts = MachineFacts(
        host_ram_bytes=host_ram_bytes(), disk_free_bytes=shutil.disk_usage(market.parent).free,
        shm_free_bytes=shm_free_bytes(), gpu_free_bytes=gpu["free_bytes"] if gpu else None,
        write_bytes_per_s=write_rate(market.parent, (16 if args.tiny else 512) * MiB),
    )  # fmt: skip
    choice = choose_models(facts, sizes, args.budget_s, max_models=args.max_models)
    print(f"machine: {facts}\nchoice: {choice}", flush=True)
    start = time.perf_counter()
    built = build(market, choice.presets, catalogue)
    build_s = time.perf_counter() - start
    layout = instance_layout([m["bytes"] for m in built], facts.gpu_free_bytes) if built else None
    result = {
        "machine": {**asdict(facts), "cpu": cpu_model(), "cpu_count": os.cpu_count()},
        "gpu": gpu, "tiny": args.tiny, **torch_version(),
        "choice": asdict(choice), "models": built, "build_s": round(build_s, 2),
        "written_gb_s": round(sum(m["bytes"] for m in built) / build_s / 1e9, 3)
        if built and build_s > 0 else None,
        "layout": asdict(layout) if layout else None, "market": str(market),
    }  # fmt: skip
    for row in built:
        print(f"  {row['name']}: {row['bytes'] / 1e9:.2f} GB in {row['write_s']} s")
    if args.json:
        print(json.dumps(result))
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
