"""A follower's device buffer, and its KV region as rank 0 maps it.

Rank 0 moves a sharded model's KV for the whole group (``aegaeon_runtime.kv``),
so it maps every follower's KV region. What crosses between them is a handle
in plain JSON (through the group's rendezvous store, never pickled):

- CPU: the follower's whole buffer is an anonymous shared file (``memfd``), so
  nothing appears in /dev/shm and nothing can be left there; rank 0 opens it
  through ``/proc/<pid>/fd/<fd>`` (same host and PID namespace: the group is
  one container) and maps the KV part.
- CUDA: the KV region's CUDA IPC memory handle (``torch.multiprocessing``'s
  reduction of the tensor, its fields written out); rank 0 opens it on the
  follower's device. Device numbers mean the same in both: one process tree
  with one ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch
from aegaeon_gpumem import DeviceBuffer

MEMFD = "memfd"
CUDA_IPC = "cuda_ipc"
_ALIGN = 4096


class PeerRegion:
    """A mapped peer KV region: ``tensor``; ``close`` drops the mapping."""

    def __init__(self, tensor: torch.Tensor, mapping: mmap.mmap | None = None) -> None:
        self.tensor = tensor
        self._mapping = mapping

    def close(self) -> None:
        # a tensor over the mapping may outlive this (a copy in flight holds it): the
        # mapping goes when the last of them does
        self._mapping = None


def follower_buffer(nbytes: int, kv_bytes: int, device: torch.device) -> tuple[DeviceBuffer, Any]:
    """A follower's device buffer: on the CPU over a ``memfd`` (shared with rank 0),
    elsewhere the ordinary one. Returns the buffer and what keeps its memory alive."""
    if device.type != "cpu":
        return DeviceBuffer(nbytes, kv_bytes, device), None
    fd = os.memfd_create("aegaeon-tp-buffer", 0)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    tensor.zero_()  # resident now, as DeviceBuffer's prefault
    return DeviceBuffer.over(tensor, kv_bytes), (fd, mapping)


def export_kv(buffer: DeviceBuffer, keep: Any) -> dict[str, Any]:
    """The handle of ``buffer``'s KV region (see the module docstring)."""
    region = buffer.kv_region
    if region.device.type == "cpu":
        fd, _ = keep
        return {"kind": MEMFD, "pid": os.getpid(), "fd": fd, "offset": buffer.kv_offset,
                "nbytes": region.numel(), "total": buffer.nbytes}  # fmt: skip
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(region)  # type: ignore[no-untyped-call]
    (_, size, stride, offset, storage_cls, _, device, handle, storage_bytes, storage_offset,
     _, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return {"kind": CUDA_IPC, "size": list(size), "stride": list(stride), "offset": offset,
            "storage": storage_cls.__name__, "device": device, "handle": handle.hex(),
            "storage_bytes": storage_bytes, "storage_offset": storage_offset,
            "ref_handle": ref_handle.hex(), "ref_offset": ref_offset,
            "event_handle": event_handle.hex() if event_handle else "",
            "event_sync": bool(event_sync)}  # fmt: skip


def import_kv(handle: dict[str, Any]) -> PeerRegion:
    """Map a follower's KV region from :func:`export_kv`'s handle."""
    if handle.get("kind") == MEMFD:
        fd = os.open(f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}", os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, int(handle["total"]), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        start = int(handle["offset"])
        return PeerRegion(whole[start:start + int(handle["nbytes"])], mapping)
    if handle.get("kind") == CUDA_IPC:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        storages = {"TypedStorage": torch.storage.TypedStorage,
                    "UntypedStorage": torch.UntypedStorage}  # fmt: skip
        storage_cls = storages.get(str(handle["storage"]))
        if storage_cls is None:
            raise ValueError(f"a CUDA IPC handle of an unknown storage {handle['storage']!r}")
        event = bytes.fromhex(handle["event_handle"]) if handle["event_handle"] else None
        tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor, torch.Size(handle["size"]), tuple(handle["stride"]), handle["offset"],
            storage_cls, torch.uint8, int(handle["device"]), bytes.fromhex(handle["handle"]),
            int(handle["storage_bytes"]), int(handle["storage_offset"]), False,
            bytes.fromhex(handle["ref_handle"]), int(handle["ref_offset"]), event,
            bool(handle["event_sync"]),
        )  # fmt: skip
        return PeerRegion(tensor)
    raise ValueError(f"unknown peer region handle kind {handle.get('kind')!r}")
