"""The paper scenario's models: what the machine holds, which presets fit, and adding them.

``python -m aegaeon_bench.gpu_check.models --market DIR --device cuda:0 --json`` reads
the machine (host RAM from /proc/meminfo, free /dev/shm where the Model Cache
lives, the GPU's free memory, how fast this host generates weights and copies
memory), chooses the models (:func:`choose_models`, pure), adds them as
in-memory entries (``aegaeon market add --random PRESET --in-memory``: no
weight file; the Model Cache generates each one's seeded weights at every
load, each with its own seed) and lays out the two instances that share the
device (:func:`instance_layout`). On a GPU the entries are FP8 (the paper's
7-8B models, 9.09 GB each for llama-3.1-8b). ``--scale small`` (the CPU-scale
scenario) and ``--scale tiny`` (the dry run): the same presets shrunk
(:func:`shrunk_preset`: a few narrow layers, their real vocabularies kept),
bfloat16. The last stdout line is the JSON object.

The rule (issues 24 and 38): the weights sum to at most 60% of the host RAM, what
/dev/shm holds beside the host KV cache, and what the host generates in the
build's time budget (every node start generates them again); every model fits
the device twice per instance beside its KV region. The preferred mix (eight
7-8B models, four presets twice) is shrunk by replacing the largest model with
the next smaller preset until it fits, and only when every model is the
smallest preset by dropping models.

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
# the paper's models: 7-8B (its market averages 25.1 GB in bf16: two per 80 GB GPU)
PREFERRED = ("llama-3.1-8b", "qwen3-8b", "qwen2.5-7b", "mistral-7b-v0.3") * 2
RAM_FRACTION = 0.6  # eight 8B FP8 models (~70 GB) on a 128 GiB host
SHM_FRACTION = 0.95
GPU_DTYPE = "fp8"  # the market's --dtype: FP8 projections, the rest bfloat16
SMALL_DTYPE = "bfloat16"
# The H100's host link as measured (docs/results.md, pinned host -> device): the
# CPU-scale scenario charges the baseline this CPU's copy rate x 16 / it, as the
# paper's artifact charges 16 GB/s against a GPU's link.
GPU_LINK_GB_S = 52.2
ARTIFACT_LOAD_GB_S = 16.0
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


@dataclass(frozen=True)
class MachineFacts:
    """What the machine reports (bytes; ``gpu_free_bytes`` None on a CPU);
    ``generate_bytes_per_s``: in-memory weights generated per second."""

    host_ram_bytes: int
    shm_free_bytes: int
    gpu_free_bytes: int | None
    generate_bytes_per_s: float


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
        "shm": int(SHM_FRACTION * facts.shm_free_bytes)
        - host_kv_bytes(facts.gpu_free_bytes is not None),
        "generation": int(facts.generate_bytes_per_s * build_budget_s),
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
    device (up to a cap) as each one's KV region; on a CPU a small KV region. The
    scenario serves with ``--device-memory`` = ``device_memory_bytes`` (the cap), which
    splits it the same way."""
    largest = max(weight_bytes)
    arena = ARENA_MODELS * largest + ARENA_SLACK_BYTES
    if gpu_free_bytes is None:
        # at least a quarter of the buffer, so `serve --device-memory` keeps two models
        # in the arena (aegaeon_sched.sizing.split_buffer)
        kv = max(CPU_KV_BYTES, (-(-arena // (3 * MiB)) + 1) * MiB)
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


def generate_rate(nbytes: int = 256 * MiB, threads: int | None = None) -> float:
    """Bytes/s of seeded weights generated into fresh host memory (what the Model Cache
    does at a load): a bf16 projection of ``nbytes`` (best of two)."""
    import torch
    from aegaeon_engine.random_weights import (
        CHUNK_BYTES,
        PeriodicValues,
        generation_threads,
        tensor_windows,
    )

    values = PeriodicValues(torch.bfloat16, seed=1)
    rows = nbytes // 2 // 4096
    best = 0.0
    for _ in range(2):
        dest = torch.empty(rows * 4096 * 2, dtype=torch.uint8)
        windows = list(tensor_windows(values, "rate", 1, "x.q_proj.weight", (rows, 4096),
                                      (0.02, 0.0), ()))  # fmt: skip
        start = time.perf_counter()
        _copy_windows(dest, windows, threads or generation_threads(), CHUNK_BYTES)
        best = max(best, dest.numel() / (time.perf_counter() - start))
    return best


def _copy_windows(dest: Any, windows: list[Any], threads: int, chunk_bytes: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    batches: list[list[tuple[int, Any]]] = [[]]
    pos = size = 0
    for window in windows:
        if size >= chunk_bytes:
            batches.append([])
            size = 0
        batches[-1].append((pos, window))
        pos += window.numel()
        size += window.numel()

    def run(batch: list[tuple[int, Any]]) -> None:
        for offset, window in batch:
            dest[offset:offset + window.numel()].copy_(window)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(run, batches))


def copy_rate(nbytes: int = 256 * MiB) -> float:
    """Bytes/s of the switcher's host copy (``aegaeon_gpumem.copy_chunked``) between two
    warm buffers, best of three: this host's memcpy."""
    import torch
    from aegaeon_gpumem import copy_chunked

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        copy_chunked(dst, src)
        best = max(best, nbytes / (time.perf_counter() - start))
    return best


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
SCALES = ("full", "small", "tiny")
SHRUNK = {  # --scale: (hidden, layers, heads, kv heads, head dim, intermediate)
    "small": (256, 4, 4, 2, 64, 768),  # the CPU-scale scenario
    "tiny": (128, 2, 4, 2, 32, 256),  # the dry run
}


def shrunk_preset(preset: Any, scale: str) -> Any:
    """``preset`` with a few narrow layers (its family, vocabulary and config keys kept):
    the CPU's stand-in, its real-size embeddings beside a few MB of layers."""
    from dataclasses import replace

    hidden, layers, heads, kv_heads, head_dim, inter = SHRUNK[scale]
    recipe = replace(preset.recipe, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter)
    return replace(preset, recipe=recipe)


def tiny_preset(preset: Any) -> Any:
    """The dry run's shrunk preset (``shrunk_preset(preset, "tiny")``)."""
    return shrunk_preset(preset, "tiny")


def presets(scale: str) -> dict[str, Any]:
    from aegaeon_market.presets import PRESETS

    return {name: p if scale == "full" else shrunk_preset(p, scale)
            for name, p in PRESETS.items()}  # fmt: skip


def weight_bytes(preset: Any, dtype: str) -> int:
    """What ``preset`` in ``dtype`` (``fp8`` too) holds in the Model Cache and the arena:
    its packed layout (no tensor is made)."""
    from aegaeon_engine import ModelSpec, weight_layout
    from aegaeon_market.fp8_out import FLOAT_DTYPE, fp8_config
    from aegaeon_market.presets import preset_config

    if dtype == "fp8":
        config = fp8_config(preset_config(preset, FLOAT_DTYPE))
        return weight_layout(ModelSpec.from_config(config), FLOAT_DTYPE).total_bytes
    return weight_layout(ModelSpec.from_config(preset_config(preset, dtype)), dtype).total_bytes


def model_name(index: int, preset: str) -> str:
    return f"m{index}-{preset}"


def build(market: Path, chosen: Sequence[str], catalogue: Mapping[str, Any], dtype: str,
          sizes: Mapping[str, int]) -> list[dict[str, Any]]:  # fmt: skip
    """Add the chosen presets to ``market`` as in-memory entries (each its own seed);
    one row per model."""
    from aegaeon_market.edit import add_random

    rows = []
    for index, preset in enumerate(chosen):
        start = time.perf_counter()
        entry = add_random(market, catalogue[preset], model_name(index, preset), dtype,
                           progress=False, replace_existing=True, in_memory=True)  # fmt: skip
        assert entry.in_memory is not None
        rows.append({"name": entry.name, "preset": preset, "params": int(entry.params),
                     "dtype": entry.dtype, "seed": entry.in_memory.seed,
                     "bytes": int(sizes[preset]),
                     "add_s": round(time.perf_counter() - start, 3)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--market", type=Path, required=True, help="the market to add to")
    parser.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    parser.add_argument("--max-models", type=int, default=len(PREFERRED))
    parser.add_argument("--budget-s", type=float, default=30.0,
                        help="seconds a node start may take generating the models at the "
                        "measured rate (30)")
    parser.add_argument("--scale", choices=SCALES, default="full",
                        help="full: the presets as released; small: shrunk (the CPU-scale "
                        "scenario); tiny: shrunk further (the dry run)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    args = parser.parse_args(argv)
    market = args.market.resolve()
    market.parent.mkdir(parents=True, exist_ok=True)
    gpu = gpu_memory(args.device)
    catalogue = presets(args.scale)
    dtype = GPU_DTYPE if args.scale == "full" else SMALL_DTYPE
    import aegaeon_market.edit  # noqa: F401  (torch: imported before anything is timed)
    sizes = {name: weight_bytes(p, dtype) for name, p in catalogue.items()}
    facts = MachineFacts(
        host_ram_bytes=host_ram_bytes(), shm_free_bytes=shm_free_bytes(),
        gpu_free_bytes=gpu["free_bytes"] if gpu else None,
        generate_bytes_per_s=generate_rate((64 if args.scale == "tiny" else 256) * MiB),
    )  # fmt: skip
    copy_bytes_per_s = copy_rate((64 if args.scale == "tiny" else 256) * MiB)
    choice = choose_models(facts, sizes, args.budget_s, max_models=args.max_models)
    print(f"machine: {facts}\nchoice: {choice}", flush=True)
    start = time.perf_counter()
    built = build(market, choice.presets, catalogue, dtype, sizes)
    build_s = time.perf_counter() - start
    layout = instance_layout([m["bytes"] for m in built], facts.gpu_free_bytes) if built else None
    result = {
        "machine": {**asdict(facts), "copy_bytes_per_s": copy_bytes_per_s, "cpu": cpu_model(),
                    "cpu_count": os.cpu_count()},
        "gpu": gpu, "scale": args.scale, "dtype": dtype, **torch_version(),
        "choice": asdict(choice), "models": built, "build_s": round(build_s, 2),
        "generate_gb_s": round(facts.generate_bytes_per_s / 1e9, 3),
        "copy_gb_s": round(copy_bytes_per_s / 1e9, 3),
        # the baseline's load path on this host: the artifact's 16 GB/s against a GPU's
        # link, scaled to this CPU's copy rate (a GPU keeps the artifact's own 16)
        "load_gb_s": ARTIFACT_LOAD_GB_S if gpu else
        round(copy_bytes_per_s / 1e9 * ARTIFACT_LOAD_GB_S / GPU_LINK_GB_S, 3),
        "layout": asdict(layout) if layout else None, "market": str(market),
    }  # fmt: skip
    for row in built:
        print(f"  {row['name']}: {row['bytes'] / 1e9:.2f} GB in memory, seed {row['seed']}")
    if args.json:
        print(json.dumps(result))
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
