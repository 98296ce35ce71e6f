"""Pick the backend from a device: the one place that branches on CPU vs CUDA
for streams (buffers, views and copies take the device as a parameter)."""

from __future__ import annotations

import torch

from aegaeon_gpumem.copies import CopyStream, CpuCopyStream
from aegaeon_gpumem.event_table import EventTable


def make_copy_stream(
    device: torch.device | str,
    table: EventTable | None = None,
    slot: int | None = None,
) -> CopyStream:
    """A copy stream for `device`: CUDA -> a torch.cuda.Stream with IPC events;
    CPU -> a worker thread signalling `slot` of `table` (both required)."""
    device = torch.device(device)
    if device.type == "cuda":
        from aegaeon_gpumem.cuda_copies import CudaCopyStream

        return CudaCopyStream(device)
    if table is None or slot is None:
        raise ValueError("a CPU copy stream needs an event table and a slot")
    return CpuCopyStream(table, slot)
