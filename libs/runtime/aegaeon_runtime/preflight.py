"""What a deployment needs of this machine, checked before any process starts.

A config can be valid and still name what this machine lacks: a ``cuda`` device
where no CUDA device is visible (or ``cuda:3`` with two), or an ``AEGAEON_ISA``
level this CPU does not have. Found by a worker, either kills it after the node
started; found here, it is one line naming the file and field (or the variable)
and nothing starts. ``aegaeon serve``/``node`` run it over every instance (their
CUDA count from a child process, so the supervisor holds no CUDA context); each
instance's own command runs it over itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aegaeon_common.config import Config, ConfigError, InstancesConfig
from aegaeon_common.env import EnvError, read_env


@dataclass(frozen=True)
class CudaDevices:
    """How many CUDA devices this process may use, and why none when none."""

    count: int
    why_none: str = ""


CudaProbe = Callable[[], CudaDevices]


@dataclass(frozen=True)
class Placed:
    """One worker instance: its name, the config field naming its device, the device."""

    name: str
    field: str
    device: str


def instance_devices(config: Config) -> list[Placed]:
    """Every worker instance the node starts and its devices, as ``aegaeon serve`` starts
    them (request-level policies: every worker a unified decode instance); a
    tensor-parallel instance once per rank (``decode-0 rank 1``)."""
    placed = []
    for kind, i in config.worker_instances:
        section: InstancesConfig = getattr(config, kind)
        field = f"{kind}.devices" if section.devices else f"{kind}.device"
        placed += [Placed(f"{kind}-{i}" + (f" rank {r}" if r else ""), field, device)
                   for r, device in enumerate(section.group_devices(i))]  # fmt: skip
    return placed


def one_instance(config: Config, kind: str, index: int) -> list[Placed]:
    """The instance ``kind-index`` alone (its own command checks itself); ConfigError
    when the config has no such instance."""
    placed = [p for p in instance_devices(config) if p.name.partition("-")[0] == kind]
    count = sum(1 for p in placed if " rank " not in p.name)
    if not 0 <= index < count:
        has = (f"{count} {kind} instance(s) (--index 0..{count - 1})" if count
               else f"no {kind} instance")  # fmt: skip
        raise ConfigError(config.source, f"{kind}.instances",
                          f"--index {index}: the config has {has}")
    return [p for p in placed if p.name.partition(" ")[0] == f"{kind}-{index}"]


def instance_preflight_or_exit(config: Config, kind: str, index: int) -> None:
    """``aegaeon prefill|decode``'s own check of itself: one line on stderr and exit
    status 2 for a mistake, before the service starts."""
    try:
        check_machine(config, one_instance(config, kind, index), torch_cuda_devices)
    except (ConfigError, EnvError) as exc:
        print(f"aegaeon {kind}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_machine(config: Config, placed: list[Placed], cuda: CudaProbe) -> None:
    """ConfigError (or EnvError) naming the first thing ``placed`` needs that this machine
    lacks; ``cuda`` is asked only when an instance is on a CUDA device."""
    on_cuda = [p for p in placed if p.device.startswith("cuda")]
    if on_cuda:
        found = cuda()
        for p in on_cuda:
            _, _, index_text = p.device.partition(":")
            index = int(index_text) if index_text else 0
            if found.count == 0:
                raise ConfigError(config.source, p.field, f"{p.name} is on {p.device!r} but no "
                                  f"CUDA device is visible ({found.why_none}); use cpu")
            if index >= found.count:
                raise ConfigError(config.source, p.field, f"{p.name} is on {p.device!r} but "
                                  f"{found.count} CUDA device(s) are visible (cuda:0.."
                                  f"cuda:{found.count - 1})")  # fmt: skip
    if any(p.device.startswith("cpu") for p in placed):
        check_isa()


def check_isa() -> None:
    """EnvError when ``AEGAEON_ISA`` names a level this CPU lacks (the engine would refuse
    it as it starts); nothing is imported unless the variable is set."""
    env = read_env()
    if env.isa is None or not env.native_kernels:
        return
    from aegaeon_engine.isa import cpu_model, supported_levels

    levels = supported_levels()
    if env.isa not in levels:
        have = ", ".join(levels) or "no native level"
        raise EnvError("AEGAEON_ISA", env.isa, f"this CPU ({cpu_model()}) supports {have}; "
                       "name one of those or unset it (the best level this CPU has)")


# a CUDA (or ROCm, or WSL) driver shows one of these; without any, torch sees no device
DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg", "/dev/kfd")


def no_driver() -> CudaDevices | None:
    """No CUDA device, and why, when this machine has no GPU driver at all (known without
    asking torch); None when torch must be asked."""
    if any(Path(p).exists() for p in DRIVER_PATHS):
        return None
    return CudaDevices(0, f"no GPU driver on this machine: no {DRIVER_PATHS[0]}")


def torch_cuda_devices() -> CudaDevices:
    """The CUDA devices torch sees in this process (an instance's own check: it is about
    to use them)."""
    none = no_driver()
    if none is not None:
        return none
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = f"CUDA {build} build, no device or driver" if build else "a CPU-only build"
        return CudaDevices(0, f"torch {torch.__version__}: {why}")
    return CudaDevices(torch.cuda.device_count())
