"""A safetensors file's header (8 bytes of length + JSON), parsed and checked so that
every defect is a ``CheckpointError`` naming the file and tensor.

Pure (no torch): the loader reads checkpoints by it, and lora_spec checks an
adapter's file by it without the tensor library.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError

# safetensors dtype code -> item size
_CODE_BYTES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F64": 8, "F32": 4, "BF16": 2, "F16": 2}
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor's bytes are: ``[start, start + nbytes)`` of ``file``."""

    file: Path
    code: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate one safetensors file's header."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(path, "header", f"corrupt safetensors header length "
                                      f"{length} in a file of {size} bytes")
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(path, None, "missing file") from None
    except OSError as exc:
        raise CheckpointError(path, None, f"cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, "header", f"corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header", "corrupt safetensors header (not an object)")
    data_start = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start, size)
    return entries


def _entry(path: Path, name: str, info: Any, data_start: int, size: int) -> TensorEntry:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(path, name, f"corrupt safetensors header: {what}")

    if not isinstance(info, dict):
        raise bad("entry is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in _CODE_BYTES:
        raise bad(f"unknown dtype {code!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise bad(f"bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"bad data_offsets {offsets!r}")
    nbytes = offsets[1] - offsets[0]
    if nbytes != math.prod(shape) * _CODE_BYTES[code]:
        raise bad(f"data_offsets span {nbytes} bytes, shape {shape} of {code} needs "
                  f"{math.prod(shape) * _CODE_BYTES[code]}")
    if data_start + offsets[1] > size:
        raise bad(f"data ends at byte {data_start + offsets[1]} past the end of the file ({size})")
    return TensorEntry(path, code, tuple(shape), data_start + offsets[0], nbytes)
