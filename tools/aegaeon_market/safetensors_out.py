"""Write a safetensors file one tensor at a time.

``safetensors.torch.save`` needs every tensor in memory at once; an import of
a checkpoint larger than the host's memory must not. The format is simple
enough to stream: 8 bytes of header length, a JSON header (names, dtypes,
shapes, byte ranges), then the tensors' bytes in header order. The header is
written first, so every tensor's shape and dtype is fixed before any data.
A checkpoint too large for one file is split into shards as Hugging Face
splits them (`plan_shards`, `index_json`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import torch

# torch dtype -> (safetensors code, item size)
CODES: dict[torch.dtype, tuple[str, int]] = {
    torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2), torch.float16: ("F16", 2),
    torch.uint8: ("U8", 1),  # GGUF blocks kept quantized (gguf_import)
    torch.float8_e4m3fn: ("F8_E4M3", 1),  # FP8 weights (fp8_out)
}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor the file will hold."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * CODES[self.dtype][1]


class SafetensorsWriter:
    """Writes ``plans`` in order; `write` each tensor, then `close` (or use ``with``)."""

    def __init__(self, path: Path, plans: list[TensorPlan]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for plan in plans:
            header[plan.name] = {"dtype": CODES[plan.dtype][0], "shape": list(plan.shape),
                                 "data_offsets": [offset, offset + plan.nbytes]}
            offset += plan.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file: BinaryIO = path.open("wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._plans = list(plans)
        self._next = 0
        self.path = path

    def _plan(self, name: str) -> TensorPlan:
        if self._next >= len(self._plans):
            raise ValueError(f"{self.path}: tensor {name!r} beyond the planned ones")
        return self._plans[self._next]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor; it must be the next plan's name, dtype and shape."""
        plan = self._plan(name)
        if (name, tensor.dtype, tuple(tensor.shape)) != (plan.name, plan.dtype, plan.shape):
            raise ValueError(f"{self.path}: got {name} {tensor.dtype} {list(tensor.shape)}, "
                             f"planned {plan.name} {plan.dtype} {list(plan.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(data.data)
        self._next += 1

    def write_bytes(self, name: str, chunks: Iterable[memoryview]) -> None:
        """Write the next tensor from its raw bytes (planned dtype, row-major) in pieces
        that add up to its size: no tensor of its size is ever built."""
        plan = self._plan(name)
        if name != plan.name:
            raise ValueError(f"{self.path}: got {name}, planned {plan.name}")
        written = 0
        for chunk in chunks:
            self._file.write(chunk)
            written += chunk.nbytes
        if written != plan.nbytes:
            raise ValueError(f"{self.path}: {name}: got {written} bytes, planned {plan.nbytes}")
        self._next += 1

    def close(self) -> None:
        """Close the file; `ValueError` if a planned tensor was never written."""
        self._file.close()
        if self._next != len(self._plans):
            raise ValueError(f"{self.path}: {len(self._plans) - self._next} planned tensors "
                             f"not written (next: {self._plans[self._next].name})")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


def plan_shards(plans: list[TensorPlan], max_shard_bytes: int) -> dict[str, list[TensorPlan]]:
    """File name -> its tensors, in order, as ``save_pretrained`` names them: one
    ``model.safetensors`` when everything fits ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` filled in order (a larger tensor alone)."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if groups[-1] and size + plan.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(plan)
        size += plan.nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": group
            for i, group in enumerate(groups)}


def index_json(shards: dict[str, list[TensorPlan]]) -> dict[str, Any]:
    """``model.safetensors.index.json`` of ``shards``."""
    total = sum(plan.nbytes for group in shards.values() for plan in group)
    return {"metadata": {"total_size": total},
            "weight_map": {plan.name: file for file, group in shards.items() for plan in group}}
