"""Seeded random weights of a released model's shapes, written straight into a packed layout.

A random preset (``aegaeon market add --random PRESET``) on disk and one kept in
memory (``--in-memory``) share this module: the files' tensors and the Model
Cache's region are windows of one seeded periodic sequence of standard normal
draws, scaled as the market's own models are (:func:`value_scale`), so an
entry generated at load holds the bytes its written twin would load from disk.

Drawing billions of normal values would take minutes; the sequence is drawn
once (``PERIOD`` values, a prime, so the rows of any matrix start at distinct
offsets of it and no two rows are equal), each scale applied once to a
buffer holding it twice, and every tensor is then copied out of that buffer:
generation runs at memory-copy speed, in threads over chunks of the region.
The seed picks the sequence and where each tensor's window begins, so two
entries of different seeds share no weights. Embedding and output rows of ids
that name no token get a tenth of the scale (``token_id_ranges``).

FP8 (``float8_e4m3fn``): the layer projections are windows of the same
sequence as e4m3 codes (the sequence scaled so its largest magnitude is 448)
with per-row float32 scales that bring each row back to the projection's
standard deviation; everything else is bfloat16.

``random-weights.json`` in a model directory marks an entry whose weights are
generated at load, never written (:class:`RandomWeights`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aegaeon_common.dtypes import FP8_MAX, fp8_scales_offset

from .errors import CheckpointError
from .layout import WeightLayout
from .spec import FP8, ModelSpec
from .weights import TORCH_DTYPES

RANDOM_WEIGHTS_FILE = "random-weights.json"
FORMAT = 1
PERIOD = 1_048_573  # a prime: 2 MiB of bfloat16 per scale
OFF_VOCAB_SCALE = 0.1
FP8_FLOAT_DTYPE = "bfloat16"  # an FP8 entry's tensors that are not projections
PROJECTIONS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"))
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
CHUNK_BYTES = 32 << 20  # one thread's piece of a region

# Standard deviation of the final logits over the vocabulary: wide enough
# that greedy decoding is rarely near a tie.
LOGIT_STD = 6.0
# Each residual branch (attention, MLP) adds about this many embedding RMS.
BRANCH_GAIN = 2.0
# With tied embeddings the current token's own logit is boosted by about
# sqrt(hidden) / (RMS(stream) / RMS(embedding)) standard deviations; branches
# are scaled up until that boost is SELF_BOOST, or greedy text repeats the
# input token forever.
SELF_BOOST = 1.0
# Attention logits get a std of about QK_GAIN^2, peaked enough that outputs
# depend on the context and not only on the last token (uniform attention
# makes random models loop). Qwen3 normalises q and k, so there it is the
# q_norm/k_norm weight.
QK_GAIN = 1.6
QKV_BIAS_STD = 0.2
# Norm weights are near 1 but not exactly 1, so an engine that skips or
# swaps a norm weight produces different tokens.
NORM_JITTER = 0.1


# ---- the scale of each tensor ---------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """What the scales depend on: a recipe's or a spec's sizes."""

    hidden_size: int
    num_layers: int
    tie_embeddings: bool


def branch_gain(sizes: Sizes) -> float:
    """Residual branch scale, relative to the embedding RMS."""
    if not sizes.tie_embeddings:
        return BRANCH_GAIN
    needed = (sizes.hidden_size / SELF_BOOST**2 - 1) / (2 * sizes.num_layers)
    return max(BRANCH_GAIN, math.sqrt(needed))


def embedding_rms(sizes: Sizes) -> float:
    """RMS of the embedding: with tied embeddings it doubles as the output projection, so
    it sets the logit spread; otherwise unit."""
    return LOGIT_STD / math.sqrt(sizes.hidden_size) if sizes.tie_embeddings else 1.0


def _std(name: str, fan_in: int, sizes: Sizes, embed_rms: float) -> float:
    """Standard deviation of one weight; inputs to every matmul are RMS-normalised."""
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QK_GAIN / math.sqrt(fan_in)
    if name.endswith(("v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return 1.0 / math.sqrt(fan_in)
    if name.endswith("o_proj.weight"):
        # the attention output averages value rows, so it is smaller than one row
        return 2.0 * branch_gain(sizes) * embed_rms / math.sqrt(fan_in)
    if name.endswith("down_proj.weight"):
        # silu(gate) * up has an RMS of about 0.6 for unit-RMS gate and up
        return branch_gain(sizes) * embed_rms / (0.6 * math.sqrt(fan_in))
    if name == "lm_head.weight":
        return LOGIT_STD / math.sqrt(sizes.hidden_size)
    if name.endswith("bias"):
        return QKV_BIAS_STD
    raise KeyError(name)


def value_scale(name: str, shape: tuple[int, ...], sizes: Sizes) -> tuple[float, float]:
    """(std, mean) of a checkpoint tensor's values: standard normal draws are scaled, then
    shifted."""
    if name.endswith("norm.weight"):
        gain = QK_GAIN if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
        return NORM_JITTER * gain, gain
    if name == "model.embed_tokens.weight":
        return embedding_rms(sizes), 0.0
    return _std(name, shape[-1], sizes, embedding_rms(sizes)), 0.0


def is_projection(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is stored as FP8 in an FP8 entry."""
    return name.endswith(PROJECTIONS)


# ---- the sequence ---------------------------------------------------------------------------
class PeriodicValues:
    """Windows of one seeded periodic sequence of normal draws, scaled, as raw bytes.

    The values are scaled in ``dtype`` (how they are stored); ``cast`` (default
    ``dtype``) is how a layout serves them: ``dtype`` values converted, so an entry
    served in another dtype holds what its stored twin converts to."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, cast: torch.dtype | None = None
                 ) -> None:  # fmt: skip
        self.dtype = dtype
        self.cast = cast or dtype
        self._normal = torch.randn(PERIOD, generator=torch.Generator().manual_seed(seed))
        self.max_abs = float(self._normal.abs().max())  # of every window, too
        self._buffers: dict[tuple[float, float], torch.Tensor] = {}

    @property
    def itemsize(self) -> int:
        return self.cast.itemsize

    def buffer(self, std: float, mean: float) -> torch.Tensor:
        """The scaled sequence twice over, as bytes (any window of one period is
        contiguous)."""
        key = (std, mean)
        if key not in self._buffers:
            once = (self._normal * std + mean).to(self.dtype).to(self.cast)
            self._buffers[key] = torch.cat([once, once]).view(torch.uint8)
        return self._buffers[key]

    def windows(self, start: int, count: int, std: float, mean: float
                ) -> Iterator[torch.Tensor]:  # fmt: skip
        """Bytes of values ``start .. start + count`` of the sequence, scaled."""
        buffer, itemsize = self.buffer(std, mean), self.itemsize
        offset = start % PERIOD  # a whole period later, the sequence is back at offset
        while count > 0:
            n = min(count, PERIOD)
            yield buffer[offset * itemsize:(offset + n) * itemsize]
            count -= n

    def chunks(self, start: int, count: int, std: float, mean: float) -> Iterator[memoryview]:
        """:meth:`windows` as memoryviews (a file writer's chunks)."""
        for window in self.windows(start, count, std, mean):
            yield window.numpy().data


def window_start(preset: str, tensor: str, seed: int) -> int:
    """Where ``tensor``'s window of the sequence begins (seed 0: as random presets were
    always written)."""
    key = f"aegaeon-preset:{preset}:{tensor}" + (f":seed{seed}" if seed else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def row_factors(name: str, num_rows: int, token_id_ranges: Sequence[tuple[int, int]]
                ) -> list[tuple[int, int, float]]:  # fmt: skip
    """``(first, end, factor)`` row ranges covering the tensor: vocabulary rows of ids
    outside the tokenizer are scaled down."""
    if name not in VOCAB_ROWS:
        return [(0, num_rows, 1.0)]
    out, row = [], 0
    for first_id, end_id in token_id_ranges:
        start, end = min(first_id, num_rows), min(end_id, num_rows)
        if start > row:
            out.append((row, start, OFF_VOCAB_SCALE))
        if end > start:
            out.append((start, end, 1.0))
        row = max(row, end)
    if row < num_rows:
        out.append((row, num_rows, OFF_VOCAB_SCALE))
    return out


def tensor_windows(values: PeriodicValues, preset: str, seed: int, name: str,
                   shape: tuple[int, ...], std_mean: tuple[float, float],
                   token_id_ranges: Sequence[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """The bytes of checkpoint tensor ``name`` (``shape``) at ``std_mean``, in order."""
    std, mean = std_mean
    start = window_start(preset, name, seed)
    row = math.prod(shape[1:])
    for first, end, factor in row_factors(name, shape[0], token_id_ranges):
        yield from values.windows(start + first * row, (end - first) * row, std * factor, mean)


# ---- an entry generated at load -------------------------------------------------------------
@dataclass(frozen=True)
class RandomWeights:
    """A model directory's ``random-weights.json``: its weights are generated at load
    (never on disk) from ``preset``'s name, ``seed`` and the stored ``dtype``."""

    preset: str
    dtype: str  # bfloat16 | float16 | float32 | float8_e4m3fn
    seed: int
    token_id_ranges: tuple[tuple[int, int], ...]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "preset": self.preset, "dtype": self.dtype,
                           "seed": self.seed,
                           "token_id_ranges": [list(r) for r in self.token_id_ranges]},
                          indent=2) + "\n"  # fmt: skip

    def write(self, model_dir: Path) -> None:
        (model_dir / RANDOM_WEIGHTS_FILE).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> RandomWeights | None:
        """The directory's recipe, None when it has none (its weights are files);
        ``CheckpointError`` naming the file and field when it is broken."""
        path = Path(model_dir) / RANDOM_WEIGHTS_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(path, None, f"cannot read ({exc.strerror})") from None
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(path, None, f"not JSON ({exc})") from None
        return cls.from_doc(doc, path)

    @classmethod
    def from_doc(cls, doc: Any, path: Path) -> RandomWeights:
        if not isinstance(doc, dict):
            raise CheckpointError(path, None, "must be a JSON object")
        if doc.get("format") != FORMAT:
            raise CheckpointError(path, "format", f"{doc.get('format')!r} is not {FORMAT}")
        preset, dtype, seed = doc.get("preset"), doc.get("dtype"), doc.get("seed")
        if not isinstance(preset, str) or not preset:
            raise CheckpointError(path, "preset", "must be a preset's name")
        if dtype != FP8 and dtype not in TORCH_DTYPES:
            raise CheckpointError(path, "dtype", f"{dtype!r} is not one of "
                                  f"{', '.join([*TORCH_DTYPES, FP8])}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise CheckpointError(path, "seed", f"{seed!r} is not a whole number >= 0")
        ranges = doc.get("token_id_ranges")
        if not (isinstance(ranges, list) and all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
                and 0 <= r[0] <= r[1] for r in ranges)):
            raise CheckpointError(path, "token_id_ranges", "must be a list of [start, end] ids")
        return cls(preset, str(dtype), seed, tuple((int(a), int(b)) for a, b in ranges))


def check_recipe(weights: RandomWeights, layout: WeightLayout, model_dir: Path) -> None:
    """``CheckpointError`` naming the recipe unless its weights can fill ``layout`` (an FP8
    recipe for FP8 slots, float slots in a float dtype): what :func:`fill_random` would
    refuse, before any byte is made."""
    where = model_dir / RANDOM_WEIGHTS_FILE
    fp8_slots = any(slot.dtype == FP8 for slot in layout.slots)
    if fp8_slots != (weights.dtype == FP8):
        raise CheckpointError(where, "dtype", f"{weights.dtype} does not fit the layout of "
                              f"config.json ({'FP8' if fp8_slots else 'no FP8'} projections)")
    for slot in layout.slots:
        if slot.dtype != FP8 and slot.dtype not in TORCH_DTYPES:
            raise CheckpointError(where, "dtype", f"slot {slot.name}: {slot.dtype} cannot be "
                                  "generated")


@dataclass(frozen=True)
class _Copy:
    """Copy ``source`` (bytes) to ``dest[offset:]``."""

    offset: int
    source: torch.Tensor


def _slot_copies(weights: RandomWeights, spec: ModelSpec, layout: WeightLayout,
                 ) -> Iterator[tuple[int, _Copy | None]]:  # fmt: skip
    """Every byte range of the region in order: ``(slot end, copy)`` per window (None
    after a slot's last window, for progress)."""
    sizes = Sizes(spec.hidden_size, spec.num_layers, spec.tie_word_embeddings)
    stored = FP8_FLOAT_DTYPE if weights.dtype == FP8 else weights.dtype
    floats: dict[str, PeriodicValues] = {}
    codes = PeriodicValues(torch.float8_e4m3fn, weights.seed) if weights.dtype == FP8 else None

    def float_values(slot_dtype: str) -> PeriodicValues:
        if slot_dtype not in floats:
            floats[slot_dtype] = PeriodicValues(TORCH_DTYPES[stored], weights.seed,
                                                TORCH_DTYPES[slot_dtype])  # fmt: skip
        return floats[slot_dtype]

    for slot in layout.slots:
        pos = slot.offset
        fp8 = slot.dtype == FP8
        if fp8 and codes is None:
            raise CheckpointError(RANDOM_WEIGHTS_FILE, "dtype", f"{weights.dtype} entry with an "
                                  "FP8 layout (config.json's quantization_config)")
        if not fp8 and slot.dtype not in TORCH_DTYPES:
            raise CheckpointError(RANDOM_WEIGHTS_FILE, "dtype", f"slot {slot.name}: "
                                  f"{slot.dtype} cannot be generated")
        row_scales: list[torch.Tensor] = []
        for name, shape in zip(slot.sources, slot.source_shapes(), strict=True):
            std_mean = value_scale(name, shape, sizes)
            if fp8:
                assert codes is not None
                code_scale = FP8_MAX / codes.max_abs  # the sequence as codes: max at 448
                row_scales.append(torch.full((shape[0],), std_mean[0] / code_scale))
                std_mean, values = (code_scale, 0.0), codes
            else:
                values = float_values(slot.dtype)
            for window in tensor_windows(values, weights.preset, weights.seed, name, shape,
                                         std_mean, weights.token_id_ranges):  # fmt: skip
                yield slot.offset + slot.nbytes, _Copy(pos, window)
                pos += window.numel()
        if fp8:
            rows, in_features = slot.shape
            start = slot.offset + fp8_scales_offset(rows, in_features)
            yield slot.offset + slot.nbytes, _Copy(start, torch.cat(row_scales).view(torch.uint8))
        yield slot.offset + slot.nbytes, None


def _gaps(layout: WeightLayout) -> list[tuple[int, int]]:
    """The byte ranges of ``layout`` no tensor writes (zeroed, so that equal entries give
    equal regions whatever memory they land in)."""
    gaps, end = [], 0
    for slot in layout.slots:
        gaps.append((end, slot.offset))
        if slot.dtype == FP8:
            rows, in_features = slot.shape
            gaps.append((slot.offset + rows * in_features,
                          slot.offset + fp8_scales_offset(rows, in_features)))
        end = slot.offset + slot.nbytes
    gaps.append((end, layout.total_bytes))
    return [(a, b) for a, b in gaps if b > a]


def generation_threads() -> int:
    """Threads for one region: the cores this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


def fill_random(weights: RandomWeights, spec: ModelSpec, layout: WeightLayout,
                dest: torch.Tensor, progress: Callable[[int], None] | None = None,
                threads: int | None = None) -> None:
    """Write ``layout``'s bytes of the entry ``weights`` describes into ``dest`` (a CPU
    uint8 tensor of at least ``layout.total_bytes``): what loading its written twin from
    disk would give, byte for byte. Copies run ``threads`` at a time (default
    :func:`generation_threads`) in pieces of :data:`CHUNK_BYTES`; padding is zeroed."""
    for start, end in _gaps(layout):  # alignment padding, FP8 codes-to-scales gaps
        dest[start:end].zero_()
    threads = threads or generation_threads()

    def run(batch: list[_Copy]) -> None:
        for copy in batch:
            dest[copy.offset:copy.offset + copy.source.numel()].copy_(copy.source)

    batch: list[_Copy] = []
    batch_bytes = 0
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="random-weights") as pool:
        pending = []
        for slot_end, copy in _slot_copies(weights, spec, layout):
            if copy is not None:
                batch.append(copy)
                batch_bytes += copy.source.numel()
                if batch_bytes >= CHUNK_BYTES:
                    pending.append(pool.submit(run, batch))
                    batch, batch_bytes = [], 0
            elif progress is not None:
                progress(slot_end)  # (the slot's copies may still be running)
        if batch:
            pending.append(pool.submit(run, batch))
        for future in pending:
            future.result()
    if progress is not None:
        progress(layout.total_bytes)
