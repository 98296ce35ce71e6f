"""Byte copies: the thin layer that moves memory, device as a parameter.

`byte_copy` is `dst.copy_(src)`, except that CPU -> CPU copies of equal,
contiguous byte ranges are one libc `memmove` (through ctypes, which
releases the GIL): a plain memcpy, overlap-safe, and measured faster than
torch's copy kernel here (torch's vector loop does not switch to
non-temporal stores for large copies; glibc does above
`x86_non_temporal_threshold`, ~181 MiB on this machine).

`copy_chunked_cpu` is the CPU weight-load copy (Model Cache -> device
buffer; `backend.copy_chunked` picks it or the CUDA one). A second thread buys
nothing (the copy is memory-bound and the other core is busy), and chunks
below the non-temporal threshold lose the fast path for big loads, hence the
defaults: one thread, 256 MiB chunks (each chunk of a large load is itself a
plain memcpy). Cold destination pages cost far more than any of this, which
is why `DeviceBuffer` touches its pages at construction. The measurements
behind these defaults: docs/results.md, "Numbers behind defaults".
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

CPU_CHUNK_BYTES = 256 << 20
CPU_COPY_THREADS = 1


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("byte copies need contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


def byte_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`; a single memmove for equal contiguous CPU tensors of one dtype."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        nbytes = dst.numel() * dst.element_size()
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return
    dst.copy_(src)


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(num_threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        pool = _pools.get(num_threads)
        if pool is None:
            pool = _pools[num_threads] = ThreadPoolExecutor(
                num_threads, thread_name_prefix="aegaeon-chunk"
            )
        return pool


def copy_chunked_cpu(
    dst: torch.Tensor,
    src: torch.Tensor,
    chunk_bytes: int | None = None,
    num_threads: int | None = None,
) -> None:
    """Copy the bytes of `src` into `dst` in chunks; returns when the copy is done.

    Both tensors must be contiguous and of equal byte size (dtypes may differ:
    this is a byte copy, e.g. a checkpoint slot into a uint8 arena range).
    CPU to CPU: chunks of `chunk_bytes` (default CPU_CHUNK_BYTES) on `num_threads`
    threads (default CPU_COPY_THREADS; 1 = the calling thread). `backend.copy_chunked`
    picks this or the CUDA one by device.
    """
    d, s = flat_bytes(dst), flat_bytes(src)
    if d.numel() != s.numel():
        raise ValueError(f"copy_chunked size mismatch: dst {d.numel()}, src {s.numel()} bytes")
    chunk = chunk_bytes or CPU_CHUNK_BYTES
    if chunk <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk}")
    threads = num_threads or CPU_COPY_THREADS
    starts = range(0, d.numel(), chunk)

    def one(start: int) -> None:
        byte_copy(d[start : start + chunk], s[start : start + chunk])

    if threads <= 1 or len(starts) <= 1:
        for start in starts:
            one(start)
    else:
        list(_pool(threads).map(one, starts))  # list() re-raises a worker's exception
