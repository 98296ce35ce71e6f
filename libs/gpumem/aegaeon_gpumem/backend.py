"""Pick the backend from a device: the one place that branches on CPU vs CUDA
for streams and chunked loads (buffers, views and byte copies take the device as
a parameter)."""

from __future__ import annotations

import torch

from aegaeon_gpumem.copies import CopyStream, CpuCopyStream
from aegaeon_gpumem.event_table import EventTable
from aegaeon_gpumem.memcopy import copy_chunked_cpu, flat_bytes


def make_copy_stream(
    device: torch.device | str,
    table: EventTable | None = None,
    slot: int | None = None,
) -> CopyStream:
    """A copy stream for `device`: CUDA -> a torch.cuda.Stream with IPC events, each
    mirrored on `slot` of `table` when given (the cachemgr reads that: no CUDA there);
    CPU -> a worker thread signalling `slot` of `table` (both required)."""
    device = torch.device(device)
    if device.type == "cuda":
        from aegaeon_gpumem.cuda_copies import CudaCopyStream

        return CudaCopyStream(device, table, slot)
    if table is None or slot is None:
        raise ValueError("a CPU copy stream needs an event table and a slot")
    return CpuCopyStream(table, slot)


def copy_chunked(
    dst: torch.Tensor,
    src: torch.Tensor,
    chunk_bytes: int | None = None,
    num_threads: int | None = None,
) -> None:
    """The weight-load copy (Model Cache -> device buffer), done when it returns: host ->
    CUDA pipelined through a pinned stage buffer (`cuda_copies.copy_chunked_cuda`), CPU
    -> CPU in chunks on threads (`memcopy.copy_chunked_cpu`). Equal byte sizes, contiguous.
    """
    if dst.device.type == "cuda" or src.device.type == "cuda":
        from aegaeon_gpumem.cuda_copies import copy_chunked_cuda

        d, s = flat_bytes(dst), flat_bytes(src)
        if d.numel() != s.numel():
            raise ValueError(f"copy_chunked size mismatch: dst {d.numel()}, src {s.numel()} bytes")
        copy_chunked_cuda(d, s, chunk_bytes)
        return
    copy_chunked_cpu(dst, src, chunk_bytes, num_threads)
