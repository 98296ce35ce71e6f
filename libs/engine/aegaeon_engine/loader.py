"""Fill a caller's byte range with a model's packed weights from safetensors.

The safetensors header is parsed here (it is 8 bytes of length + JSON) so that
every defect is reported as a ``CheckpointError`` naming the file and tensor;
tensor bytes are read straight into the destination when no dtype conversion
is needed. A block-quantized slot (layout.py) reads its tensors' blocks, stored as
U8 ``[rows, row_bytes]``, as they are; an FP8 slot reads each tensor's F8_E4M3
codes as they are and its ``weight_scale`` (per row ``[rows, 1]`` or ``[rows]``, or
one per tensor) as float32 row scales.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import Any

import torch
from aegaeon_common.dtypes import fp8_scales_offset

from .errors import CheckpointError
from .layout import TensorSlot, WeightLayout
from .spec import FP8, QUANT_BLOCKS, ModelSpec, quant_row_bytes
from .weights import TORCH_DTYPES

# safetensors dtype code -> (torch dtype, item size); only float types load.
_FLOAT_CODES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2),
}
# read_tensor's dtypes: the floats, and FP8 codes (an FP8 checkpoint's projections)
_READ_CODES = {**_FLOAT_CODES, "F8_E4M3": (torch.float8_e4m3fn, 1)}
_CODE_BYTES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, **{k: v[1] for k, v in _FLOAT_CODES.items()}}
_MAX_HEADER_BYTES = 100 << 20
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


def checkpoint_index(model_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint (single file, or shards + index) by name."""
    root = Path(model_dir)
    if (root / SINGLE_FILE).is_file():
        return read_header(root / SINGLE_FILE)
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        if (root / "random-weights.json").is_file():
            raise CheckpointError(root / "random-weights.json", None, "an in-memory entry: its "
                                  "weights are generated at load and have no files to read")
        raise CheckpointError(root / SINGLE_FILE, None, f"missing file (and no {INDEX_FILE})")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(index_path, "weight_map", f"unreadable index ({exc!r})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index_path, "weight_map", "not an object")
    shards = {name: read_header(root / str(name)) for name in set(weight_map.values())}
    entries: dict[str, TensorEntry] = {}
    for tensor, shard in weight_map.items():
        if tensor not in shards[shard]:
            raise CheckpointError(root / str(shard), tensor,
                                  f"missing tensor (listed in {INDEX_FILE})")
        entries[tensor] = shards[shard][tensor]
    return entries


def read_tensor(entry: TensorEntry, name: str) -> torch.Tensor:
    """One float (or F8_E4M3) tensor of a checkpoint, read into memory in its stored
    dtype."""
    if entry.code not in _READ_CODES:
        raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; only float tensors "
                              "load")
    dtype = _READ_CODES[entry.code][0]
    staging = bytearray(entry.nbytes)
    try:
        with entry.file.open("rb") as f:
            _read_exact(f, entry, name, memoryview(staging))
    except OSError as exc:
        raise CheckpointError(entry.file, name, f"cannot read ({exc.strerror})") from None
    if not staging:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(staging, dtype=dtype).reshape(entry.shape)


def fill_layout(model_dir: str | Path, layout: WeightLayout,
                dest: torch.Tensor | bytearray | memoryview,
                progress: Callable[[int], None] | None = None) -> None:
    """Write ``layout``'s bytes into host memory ``dest`` (no engine needed).

    ``dest`` is a CPU uint8 tensor or a writable bytes-like object (e.g. a
    shared-memory buffer) of at least ``layout.total_bytes`` bytes. Alignment
    padding is zeroed so equal checkpoints give equal bytes. ``progress`` is
    told the bytes written so far after each tensor slot (loading progress).
    """
    out = dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)
    _check_dest(out, layout)
    if out.device.type != "cpu":
        raise ValueError("fill_layout writes host memory; use load_weights for a device tensor")
    from .random_weights import RandomWeights, fill_random

    generated = RandomWeights.from_dir(model_dir)
    if generated is not None:  # an in-memory entry: its weights are generated, not read
        fill_random(generated, ModelSpec.from_dir(model_dir), layout, out, progress)
        return
    index = checkpoint_index(model_dir)
    root = Path(model_dir)
    files: dict[Path, BufferedReader] = {}
    try:
        end = 0
        for slot in layout.slots:
            out[end:slot.offset].zero_()
            if slot.dtype == FP8:
                end = _fill_fp8(index, root, slot, out, files)
                if progress is not None:
                    progress(end)
                continue
            pos = slot.offset
            quantized = slot.dtype in QUANT_BLOCKS
            for name, logical in zip(slot.sources, slot.source_shapes(), strict=True):
                entry = index.get(name)
                if entry is None:
                    where = root / (SINGLE_FILE if (root / SINGLE_FILE).is_file() else INDEX_FILE)
                    raise CheckpointError(where, name, "missing tensor")
                # a quantized slot's blocks: uint8 [rows, row_bytes], copied as they are
                shape = ((logical[0], quant_row_bytes(slot.dtype, logical[1])) if quantized
                         else logical)
                if entry.shape != shape:
                    raise CheckpointError(entry.file, name, f"wrong shape {list(entry.shape)}, "
                                          f"expected {list(shape)}")
                if quantized and entry.code != "U8":
                    raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; "
                                          f"{slot.dtype} blocks are stored as U8")
                if not quantized and entry.code not in _FLOAT_CODES:
                    raise CheckpointError(entry.file, name,
                                          f"wrong dtype {entry.code}; only float tensors load")
                if entry.file not in files:
                    files[entry.file] = entry.file.open("rb")
                pos = _copy_tensor(files[entry.file], entry, name, out, pos=pos,
                                   dtype=torch.uint8 if quantized else TORCH_DTYPES[slot.dtype])
            end = pos
            if progress is not None:
                progress(end)
        out[end:layout.total_bytes].zero_()
    finally:
        for f in files.values():
            f.close()


def scale_name(weight: str) -> str:
    """The checkpoint name of an FP8 weight's scales (``...q_proj.weight_scale``)."""
    return weight + "_scale"


def _fill_fp8(index: dict[str, TensorEntry], root: Path, slot: TensorSlot, out: torch.Tensor,
              files: dict[Path, BufferedReader]) -> int:
    """Write FP8 ``slot`` (its sources' codes, then their row scales) into ``out``; the
    end of the bytes written."""
    rows, in_features = slot.shape
    scales = torch.empty(rows, dtype=torch.float32)
    pos, row = slot.offset, 0
    for name, logical in zip(slot.sources, slot.source_shapes(), strict=True):
        entry, scale_entry = (_fp8_entry(index, root, n) for n in (name, scale_name(name)))
        if entry.shape != logical:
            raise CheckpointError(entry.file, name, f"wrong shape {list(entry.shape)}, "
                                  f"expected {list(logical)}")
        if entry.code != "F8_E4M3":
            raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; "
                                  f"{FP8} weights are stored as F8_E4M3")
        count = logical[0]
        if scale_entry.shape not in ((), (1,), (count,), (count, 1)):
            raise CheckpointError(scale_entry.file, scale_name(name),
                                  f"wrong shape {list(scale_entry.shape)}, expected [{count}, 1] "
                                  "(per row) or [] (per tensor)")
        value = read_tensor(scale_entry, scale_name(name)).float().reshape(-1)
        if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            raise CheckpointError(scale_entry.file, scale_name(name),
                                  "scales must be positive and finite")
        scales[row:row + count] = value.expand(count)
        if entry.file not in files:
            files[entry.file] = entry.file.open("rb")
        pos = _copy_tensor(files[entry.file], entry, name, out, pos=pos, dtype=torch.uint8)
        row += count
    start = slot.offset + fp8_scales_offset(rows, in_features)
    out[pos:start].zero_()
    out[start:start + 4 * rows].copy_(scales.view(torch.uint8))
    return start + 4 * rows


def _fp8_entry(index: dict[str, TensorEntry], root: Path, name: str) -> TensorEntry:
    entry = index.get(name)
    if entry is None:
        where = root / (SINGLE_FILE if (root / SINGLE_FILE).is_file() else INDEX_FILE)
        raise CheckpointError(where, name, "missing tensor")
    return entry


def _copy_tensor(f: BufferedReader, entry: TensorEntry, name: str, out: torch.Tensor, *,
                 pos: int, dtype: torch.dtype) -> int:
    src_dtype, src_size = _FLOAT_CODES.get(entry.code, (torch.uint8, 1))
    numel = entry.nbytes // src_size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return pos
    target = out[pos:pos + nbytes]
    if src_dtype == dtype:
        _read_exact(f, entry, name, target.numpy().data)
    else:
        staging = bytearray(entry.nbytes)
        _read_exact(f, entry, name, memoryview(staging))
        converted = torch.frombuffer(staging, dtype=src_dtype).to(dtype)
        target.copy_(converted.view(torch.uint8))
    return pos + nbytes


def _read_exact(f: BufferedReader, entry: TensorEntry, name: str, into: memoryview) -> None:
    f.seek(entry.start)
    done = 0
    while done < len(into):
        n = f.readinto(into[done:])
        if not n:
            raise CheckpointError(entry.file, name, "file truncated inside the tensor data")
        done += n


def _check_dest(out: torch.Tensor, layout: WeightLayout) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"destination must be a contiguous 1-D uint8 tensor, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.numel() < layout.total_bytes:
        raise ValueError(f"destination holds {out.numel()} bytes, layout needs "
                         f"{layout.total_bytes}")


def load_weights(model_dir: str | Path, spec: ModelSpec, layout: WeightLayout,
                 dest: torch.Tensor) -> None:
    """Fill ``dest`` (a uint8 tensor on the CPU or an accelerator) with ``layout``.

    Raises ``CheckpointError`` for any defect of the checkpoint and
    ``ValueError`` when ``dest`` is too small or ``layout`` is not ``spec``'s.
    """
    if layout.model != spec.name:
        raise ValueError(f"layout is for model {layout.model!r}, spec is {spec.name!r}")
    _check_dest(dest, layout)
    if dest.device.type == "cpu":
        fill_layout(model_dir, layout, dest)
        return
    # Stage through host memory (pinned so the copy is DMA), one copy per load.
    staging = torch.empty(layout.total_bytes, dtype=torch.uint8, pin_memory=True)
    fill_layout(model_dir, layout, staging)
    dest[:layout.total_bytes].copy_(staging)
