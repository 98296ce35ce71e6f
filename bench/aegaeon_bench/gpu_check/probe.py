"""The machine and its copy limits, for `scripts/gpu-check` (`aegaeon_bench.gpu_check.probe`).

On CUDA: the GPU (torch's and nvidia-smi's view), the host <-> device copy
rates (pinned and pageable host memory, each the median of ``--repeats``
copies of ``--mib`` MiB timed to completion), and the path a worker's
scale-up takes: a /dev/shm segment mapped read-only, page-locked as the
workers do (``aegaeon_gpumem.cuda_host``: read-only where the device allows,
else mapped read-write), copied to the device, and the same segment pageable
through the stage buffer (``copy_chunked``). On a CPU: a host memcpy and the
weight-load copy (``copy_chunked``) of the same bytes.
The last stdout line is the JSON object (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from aegaeon_bench.gpu_check.models import cpu_model

SMI_FIELDS = ("name", "driver_version", "memory.total", "pcie.link.gen.current",
              "pcie.link.width.current", "power.limit")  # fmt: skip


def nvidia_smi() -> dict[str, Any] | None:
    """nvidia-smi's view of GPU 0 (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ",".join(SMI_FIELDS)
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}
    first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return dict(zip(SMI_FIELDS, (v.strip() for v in first.split(",")), strict=False))


def _gb_s(nbytes: int, fn: Callable[[], object], repeats: int, sync: bool) -> float:
    fn()  # warm: first-touch faults, lazy CUDA state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return round(nbytes / statistics.median(times) / 1e9, 2)


def cuda_copies(nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of the plain copies between host and device."""
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return {
        "h2d_pinned_gb_s": _gb_s(nbytes, lambda: dev.copy_(pinned, non_blocking=True),
                                 repeats, True),
        "h2d_pageable_gb_s": _gb_s(nbytes, lambda: dev.copy_(pageable), repeats, True),
        "d2h_pinned_gb_s": _gb_s(nbytes, lambda: pinned.copy_(dev, non_blocking=True),
                                 repeats, True),
        "d2d_gb_s": _gb_s(nbytes, lambda: dev2.copy_(dev), repeats, True),
    }


def shm_scale_up(nbytes: int, repeats: int) -> dict[str, Any]:
    """A Model Cache-like segment to the device: page-locked as a worker does, and pageable."""
    from aegaeon_gpumem import ShmRegion, copy_chunked, unique_name
    from aegaeon_gpumem.cuda_host import (
        ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED,
        ATTR_HOST_REGISTER_SUPPORTED,
        device_attribute,
        pin_region,
    )

    out: dict[str, Any] = {
        "host_register_supported": device_attribute(ATTR_HOST_REGISTER_SUPPORTED),
        "host_register_read_only_supported":
            device_attribute(ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED),
    }
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    with ShmRegion.create(unique_name("gpu-probe"), nbytes) as owner:
        owner.tensor.fill_(7)
        pageable = ShmRegion.attach(owner.name, readonly=True, populate=True)
        out["shm_pageable_gb_s"] = _gb_s(nbytes, lambda: copy_chunked(dev, pageable.tensor),
                                         repeats, False)
        ro = ShmRegion.attach(owner.name, readonly=True, populate=True)
        pin, out["pin_read_only_error"] = pin_region(ro)
        mode, region = ("ro", ro) if pin is not None else ("", None)
        if pin is None:
            rw = ShmRegion.attach(owner.name, readonly=False, populate=True)
            pin, out["pin_read_write_error"] = pin_region(rw)
            mode, region = ("rw", rw) if pin is not None else ("", None)
        out["pinned"] = mode
        if region is not None:
            src = region.tensor
            out["shm_pinned_is_pinned"] = bool(src.is_pinned())
            out["shm_pinned_gb_s"] = _gb_s(nbytes, lambda: copy_chunked(dev, src), repeats,
                                           False)
            out["shm_pinned_bytes_equal"] = bool(torch.equal(dev[:4096].cpu(), src[:4096]))
    return out


def probe(device: str, mib: int, repeats: int) -> dict[str, Any]:
    """Everything above, as one JSON-able object."""
    nbytes = mib << 20
    result: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cpu": cpu_model() or platform.processor(), "cpu_count": os.cpu_count(), "device": device,
        "nvidia_smi": nvidia_smi(), "copy_mib": mib,
    }  # fmt: skip
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        props = torch.cuda.get_device_properties(device)
        result["gpu"] = {
            "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count,
        }  # fmt: skip
        result["copies"] = cuda_copies(nbytes, repeats)
        result["model_cache"] = shm_scale_up(nbytes, repeats)
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        from aegaeon_gpumem import byte_copy, copy_chunked

        # the weight-load copy beside a plain memcpy of the same bytes (its target: >= 0.8x)
        result["copies"] = {
            "host_memcpy_gb_s": _gb_s(nbytes, lambda: byte_copy(dst, src), repeats, False),
            "host_copy_chunked_gb_s": _gb_s(nbytes, lambda: copy_chunked(dst, src), repeats,
                                            False),
        }  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_probe", description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--mib", type=int, default=256, help="bytes per copy, MiB (256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    args = parser.parse_args(argv)
    result = probe(args.device, args.mib, args.repeats)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
