"""Which GPUs a node's plan uses: ``--gpus`` (the machine's, by CUDA index) and
``--assume-gpus`` (GPUs that are not here, for a plan made elsewhere)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aegaeon_sched.placement import GiB, GpuInfo, PlacementError

__all__ = ["assumed_gpus", "parse_gpus", "select_gpus"]


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
