"""Fill a caller's byte range with a model's packed weights from safetensors.

The safetensors header is parsed by st_header (every defect a ``CheckpointError``
naming the file and tensor); tensor bytes are read straight into the destination
when no dtype conversion is needed. A block-quantized slot (layout.py) reads its
tensors' blocks, stored as U8 ``[rows, row_bytes]``, as they are; an FP8 slot reads
each tensor's F8_E4M3 codes as they are and its ``weight_scale`` (per row
``[rows, 1]`` or ``[rows]``, or one per tensor) as float32 row scales.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path

import torch
from aegaeon_common.dtypes import fp8_scales_offset
from aegaeon_common.market_files import digest_mismatch

from .errors import CheckpointError
from .layout import TensorSlot, WeightLayout
from .spec import FP8, QUANT_BLOCKS, ModelSpec, quant_row_bytes
from .st_header import TensorEntry, read_header
from .weights import TORCH_DTYPES

# safetensors dtype code -> (torch dtype, item size); only float types load.
_FLOAT_CODES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2),
}
# read_tensor's dtypes: the floats, and FP8 codes (an FP8 checkpoint's projections)
_READ_CODES = {**_FLOAT_CODES, "F8_E4M3": (torch.float8_e4m3fn, 1)}
_HASH_CHUNK_BYTES = 8 << 20  # bytes read at a time for a digest alone
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


def read_tensor(entry: TensorEntry, name: str, *, blocks: bool = False) -> torch.Tensor:
    """One float (or F8_E4M3) tensor of a checkpoint, read into memory in its stored
    dtype; with ``blocks``, a block-quantized matrix's U8 ``[rows, row_bytes]`` instead."""
    codes = {"U8": (torch.uint8, 1)} if blocks else _READ_CODES
    if entry.code not in codes:
        raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; " + (
            "quantized blocks are stored as U8" if blocks else "only float tensors load"))
    dtype = codes[entry.code][0]
    staging = bytearray(entry.nbytes)
    try:
        with entry.file.open("rb") as f:
            _read_exact(f, entry, name, memoryview(staging))
    except OSError as exc:
        raise CheckpointError(entry.file, name, f"cannot read ({exc.strerror})") from None
    if not staging:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(staging, dtype=dtype).reshape(entry.shape)


@dataclass(frozen=True)
class _Read:
    """One checkpoint tensor's bytes and where they go in the packed layout: at ``pos``
    as ``dtype`` (converted from the stored dtype), or, with ``scale_rows``, FP8 row
    scales: ``scale_rows`` float32 values (one per tensor: repeated) at ``pos``."""

    entry: TensorEntry
    name: str
    pos: int
    dtype: torch.dtype
    scale_rows: int = 0

    @property
    def out_bytes(self) -> int:
        if self.scale_rows:
            return 4 * self.scale_rows
        numel = self.entry.nbytes // _FLOAT_CODES.get(self.entry.code, (torch.uint8, 1))[1]
        return numel * torch.empty((), dtype=self.dtype).element_size()


def plan_reads(model_dir: str | Path, layout: WeightLayout) -> list[_Read]:
    """Every read :func:`fill_layout` makes, in layout order, each tensor's name, shape
    and dtype checked against ``layout`` (``CheckpointError`` naming the file and tensor
    at fault). Reads only the checkpoint's headers."""
    index = checkpoint_index(model_dir)
    root = Path(model_dir)
    reads: list[_Read] = []
    for slot in layout.slots:
        if slot.dtype == FP8:
            reads += _fp8_reads(index, root, slot)
            continue
        pos = slot.offset
        quantized = slot.dtype in QUANT_BLOCKS
        dtype = torch.uint8 if quantized else TORCH_DTYPES[slot.dtype]
        for name, logical in zip(slot.sources, slot.source_shapes(), strict=True):
            # a quantized slot's blocks: uint8 [rows, row_bytes], copied as they are
            shape = ((logical[0], quant_row_bytes(slot.dtype, logical[1])) if quantized
                     else logical)
            entry = tensor_entry(index, root, name, shape, floats=not quantized)
            if quantized and entry.code != "U8":
                raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; "
                                      f"{slot.dtype} blocks are stored as U8")
            reads.append(_Read(entry, name, pos, dtype))
            pos += reads[-1].out_bytes
    return reads


def check_checkpoint(model_dir: str | Path, layout: WeightLayout) -> None:
    """``CheckpointError`` (naming the file and tensor) unless every tensor ``layout``
    needs is in the checkpoint with its shape and dtype and its bytes inside its file: what
    a load would find wrong before the first byte of data, at the cost of the headers. An
    in-memory entry: its recipe (``random-weights.json``) must parse and fit the layout."""
    from .random_weights import RandomWeights, check_recipe

    generated = RandomWeights.from_dir(model_dir)
    if generated is not None:
        check_recipe(generated, layout, Path(model_dir))
        return
    plan_reads(model_dir, layout)


def fill_layout(model_dir: str | Path, layout: WeightLayout,
                dest: torch.Tensor | bytearray | memoryview,
                progress: Callable[[int], None] | None = None,
                digests: Mapping[Path, str] | None = None) -> set[Path]:
    """Write ``layout``'s bytes into host memory ``dest`` (no engine needed).

    ``dest`` is a CPU uint8 tensor or a writable bytes-like object (e.g. a
    shared-memory buffer) of at least ``layout.total_bytes`` bytes. Alignment
    padding is zeroed so equal checkpoints give equal bytes. ``progress`` is
    told the bytes written so far after each tensor (loading progress).

    Each file is read once, front to back (its tensors in the order they are stored,
    whatever the layout's order); ``digests`` (file -> SHA-256 hex) are checked on the
    way, the bytes hashed as they are read (a file read out of order, or with bytes
    no tensor uses, has those read for the hash alone): a file whose content differs is
    a ``CheckpointError``. Returns the files read.
    """
    out = dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)
    _check_dest(out, layout)
    if out.device.type != "cpu":
        raise ValueError("fill_layout writes host memory; use load_weights for a device tensor")
    from .random_weights import RandomWeights, fill_random

    generated = RandomWeights.from_dir(model_dir)
    if generated is not None:  # an in-memory entry: its weights are generated, not read
        fill_random(generated, ModelSpec.from_dir(model_dir), layout, out, progress)
        return set()
    reads = plan_reads(model_dir, layout)
    _zero_gaps(out, reads, layout.total_bytes)
    by_file: dict[Path, list[_Read]] = {}
    for read in reads:
        by_file.setdefault(read.entry.file, []).append(read)
    done = 0
    for path in sorted(by_file):
        expected = digests.get(path) if digests else None
        try:
            with path.open("rb") as f:
                digest = _FileDigest(f) if expected is not None else None
                try:
                    for read in sorted(by_file[path], key=lambda r: r.entry.start):
                        _execute(f, read, out, digest)
                        done += read.out_bytes
                        if progress is not None:
                            progress(done)
                    got = digest.finish() if digest is not None else None
                finally:
                    if digest is not None:
                        digest.close()
        except OSError as exc:
            raise CheckpointError(path, None, f"cannot read ({exc.strerror})") from None
        if expected is not None and got != expected:
            raise CheckpointError(path, None, digest_mismatch(got or "", expected))
    if progress is not None:
        progress(layout.total_bytes)
    return set(by_file)


def scale_name(weight: str) -> str:
    """The checkpoint name of an FP8 weight's scales (``...q_proj.weight_scale``)."""
    return weight + "_scale"


def _fp8_reads(index: dict[str, TensorEntry], root: Path, slot: TensorSlot) -> list[_Read]:
    """FP8 ``slot``'s reads: each source's codes as they are, then their row scales after
    the codes (float32, at the slot's scales offset)."""
    rows, in_features = slot.shape
    start = slot.offset + fp8_scales_offset(rows, in_features)
    reads: list[_Read] = []
    pos, row = slot.offset, 0
    for name, logical in zip(slot.sources, slot.source_shapes(), strict=True):
        entry = tensor_entry(index, root, name, logical)
        if entry.code != "F8_E4M3":
            raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; "
                                  f"{FP8} weights are stored as F8_E4M3")
        count = logical[0]
        scale_entry = tensor_entry(index, root, scale_name(name), floats=True)
        if scale_entry.shape not in ((), (1,), (count,), (count, 1)):
            raise CheckpointError(scale_entry.file, scale_name(name),
                                  f"wrong shape {list(scale_entry.shape)}, expected [{count}, 1] "
                                  "(per row) or [] (per tensor)")
        reads.append(_Read(entry, name, pos, torch.uint8))
        pos += reads[-1].out_bytes
        reads.append(_Read(scale_entry, scale_name(name), start + 4 * row, torch.float32,
                           scale_rows=count))
        row += count
    return reads


def tensor_entry(index: dict[str, TensorEntry], root: Path, name: str,
                 shape: tuple[int, ...] | None = None, *, floats: bool = False) -> TensorEntry:
    """``name``'s entry in checkpoint ``root``'s ``index``, of ``shape`` (when given) and,
    with ``floats``, a float dtype (``CheckpointError`` naming the file otherwise)."""
    entry = index.get(name)
    if entry is None:
        where = root / (SINGLE_FILE if (root / SINGLE_FILE).is_file() else INDEX_FILE)
        raise CheckpointError(where, name, "missing tensor")
    if shape is not None and entry.shape != shape:
        raise CheckpointError(entry.file, name, f"wrong shape {list(entry.shape)}, "
                              f"expected {list(shape)}")
    if floats and entry.code not in _FLOAT_CODES:
        raise CheckpointError(entry.file, name, f"wrong dtype {entry.code}; only float "
                              "tensors load")
    return entry


def _zero_gaps(out: torch.Tensor, reads: list[_Read], total_bytes: int) -> None:
    """Zero every byte of ``[0, total_bytes)`` no read writes (alignment padding)."""
    end = 0
    for read in sorted(reads, key=lambda r: r.pos):
        if read.pos > end:
            out[end:read.pos].zero_()
        end = max(end, read.pos + read.out_bytes)
    if total_bytes > end:
        out[end:total_bytes].zero_()


class _FileDigest:
    """The SHA-256 of a file read front to back by :func:`fill_layout`, computed on a
    thread of its own as the bytes arrive (hashlib lets go of the GIL), so that the
    hash overlaps the reads: the bytes between the tensors read (the header, unused
    tensors) are read here for the hash; a file read out of order (overlapping
    tensors) is hashed by a second pass. :meth:`close` in every case."""

    def __init__(self, f: BufferedReader) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self._pos = 0  # the next byte to hash
        self._in_order = True
        # at most this many reads wait for the hash (each holds its bytes)
        self._pending: queue.Queue[memoryview | bytes | bytearray | None] = queue.Queue(4)
        self._thread = threading.Thread(target=self._run, name="aegaeon-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._pending.get()) is not None:
            self._hash.update(data)

    def skip_to(self, start: int) -> None:
        """Hash the bytes up to ``start`` (a read begins there)."""
        if start < self._pos:
            self._in_order = False
        elif self._in_order:
            self._hash_from_file(self._pos, start)

    def add(self, start: int, data: memoryview | bytearray) -> None:
        """``data``, read from ``start`` (not written to again while it is hashed)."""
        if self._in_order and start == self._pos:
            self._pending.put(data)
            self._pos += len(data)
        else:
            self._in_order = False

    def finish(self) -> str:
        if self._in_order:
            self._hash_from_file(self._pos, None)
            self.close()
        else:
            self.close()
            self._hash, self._pos, self._in_order = hashlib.sha256(), 0, True
            self._hash_from_file(0, None, on_thread=False)
        return self._hash.hexdigest()

    def close(self) -> None:
        """Stop the hashing thread (after what is queued)."""
        if self._thread.is_alive():
            self._pending.put(None)
            self._thread.join()

    def _hash_from_file(self, start: int, end: int | None, on_thread: bool = True) -> None:
        self._f.seek(start)
        pos = start
        while end is None or pos < end:
            chunk = self._f.read(_HASH_CHUNK_BYTES if end is None
                                 else min(_HASH_CHUNK_BYTES, end - pos))
            if not chunk:
                break
            if on_thread:
                self._pending.put(chunk)
            else:
                self._hash.update(chunk)
            pos += len(chunk)
        self._pos = pos


def _execute(f: BufferedReader, read: _Read, out: torch.Tensor,
             digest: _FileDigest | None) -> None:
    """Read one tensor into ``out`` (see :class:`_Read`)."""
    entry, name = read.entry, read.name
    if digest is not None:
        digest.skip_to(entry.start)
    if read.scale_rows:
        staging = bytearray(entry.nbytes)
        _read_exact(f, entry, name, memoryview(staging))
        if digest is not None:
            digest.add(entry.start, staging)
        src_dtype = _FLOAT_CODES[entry.code][0]
        value = (torch.frombuffer(staging, dtype=src_dtype).float().reshape(-1) if staging
                 else torch.empty(0))  # fmt: skip
        if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            raise CheckpointError(entry.file, name, "scales must be positive and finite")
        scales = value.expand(read.scale_rows).contiguous()
        out[read.pos:read.pos + read.out_bytes].copy_(scales.view(torch.uint8))
        return
    src_dtype = _FLOAT_CODES.get(entry.code, (torch.uint8, 1))[0]
    nbytes = read.out_bytes
    if nbytes == 0:
        return
    target = out[read.pos:read.pos + nbytes]
    if src_dtype == read.dtype:
        view = target.numpy().data
        _read_exact(f, entry, name, view)
        if digest is not None:
            digest.add(entry.start, view)
    else:
        staging = bytearray(entry.nbytes)
        _read_exact(f, entry, name, memoryview(staging))
        if digest is not None:
            digest.add(entry.start, staging)
        converted = torch.frombuffer(staging, dtype=src_dtype).to(read.dtype)
        target.copy_(converted.view(torch.uint8))


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
