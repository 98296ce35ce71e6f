"""Write a preset's model directory at the speed of the disk.

Drawing billions of normal values would take minutes; measuring speed and
switching needs the real shapes and bytes, and values that keep activations
finite and greedy text varied. So every tensor is a window of one seeded
periodic sequence of standard normal draws, scaled as the market's own models
are (`weights.value_scale`). The period is prime, so the rows of any matrix
start at distinct offsets of it and no two rows are equal. Each scale is
applied once, in the stored dtype, to a buffer holding the sequence twice;
a tensor is then written as slices of that buffer straight into its
safetensors file: no tensor of its size is built and nothing is written
twice. Embedding and output rows of ids that name no token (a released
vocabulary is larger than the tokenizer trained here) get a tenth of the
scale, so sampled tokens stay within the tokenizer.

In FP8 (fp8_out.py) the projections are windows of the same sequence, as e4m3
codes: the sequence scaled so its largest magnitude is 448, once, and every row
of a projection gets the scale that brings it back to the projection's
standard deviation (no row of a window exceeds the sequence's maximum), so an
FP8 preset is written as fast as a bfloat16 one and dequantizes to nearly its
values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from aegaeon_common.dtypes import FP8_MAX
from aegaeon_engine.fp8 import FP8_DTYPE
from aegaeon_engine.loader import scale_name
from aegaeon_engine.spec import FP8, ModelSpec
from aegaeon_engine.weights import TORCH_DTYPES

from aegaeon_market.families import Vocab
from aegaeon_market.fp8_out import FLOAT_DTYPE, fp8_config, fp8_plans, is_projection
from aegaeon_market.model_files import expected_tensors
from aegaeon_market.presets import Preset, preset_config
from aegaeon_market.safetensors_out import SafetensorsWriter, TensorPlan, index_json, plan_shards
from aegaeon_market.shapes import tensor_shapes
from aegaeon_market.weights import value_scale
from aegaeon_market.writer import write_json, write_text_files

PERIOD = 1_048_573  # a prime: 2 MiB of bfloat16 per scale
SEED = 0
OFF_VOCAB_SCALE = 0.1
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB")
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


class PeriodicValues:
    """Windows of one seeded periodic sequence of normal draws, scaled, as raw bytes."""

    def __init__(self, dtype: torch.dtype, seed: int = SEED) -> None:
        self.dtype = dtype
        self._normal = torch.randn(PERIOD, generator=torch.Generator().manual_seed(seed))
        self.max_abs = float(self._normal.abs().max())  # of every window, too
        self._buffers: dict[tuple[float, float], torch.Tensor] = {}

    def _buffer(self, std: float, mean: float) -> memoryview:
        """The scaled sequence twice over (so any window of one period is contiguous)."""
        key = (std, mean)
        if key not in self._buffers:
            once = (self._normal * std + mean).to(self.dtype)
            self._buffers[key] = torch.cat([once, once]).view(torch.uint8)
        return self._buffers[key].numpy().data

    def chunks(self, start: int, count: int, std: float, mean: float) -> Iterator[memoryview]:
        """Bytes of values ``start .. start + count`` of the sequence, scaled."""
        buffer, itemsize = self._buffer(std, mean), self.dtype.itemsize
        offset = start % PERIOD  # a whole period later, the sequence is back at offset
        while count > 0:
            n = min(count, PERIOD)
            yield buffer[offset * itemsize:(offset + n) * itemsize]
            count -= n


def _row_factors(name: str, num_rows: int, vocab: Vocab) -> list[tuple[int, int, float]]:
    """``(first, end, factor)`` row ranges covering the tensor: vocabulary rows of ids
    outside the tokenizer are scaled down."""
    if name not in _VOCAB_ROWS:
        return [(0, num_rows, 1.0)]
    out, row = [], 0
    for start, end in vocab.token_id_ranges:
        if start > row:
            out.append((row, start, OFF_VOCAB_SCALE))
        out.append((start, end, 1.0))
        row = end
    if row < num_rows:
        out.append((row, num_rows, OFF_VOCAB_SCALE))
    return out


def _tensor_chunks(values: PeriodicValues, preset: Preset, plan: TensorPlan,
                   std_mean: tuple[float, float] | None = None) -> Iterator[memoryview]:
    """The bytes of ``plan``'s tensor; ``std_mean``: that scale instead of its own."""
    recipe = preset.recipe
    std, mean = std_mean or value_scale(plan.name, plan.shape, recipe)
    digest = hashlib.sha256(f"aegaeon-preset:{preset.name}:{plan.name}".encode()).digest()
    start = int.from_bytes(digest[:8], "little")  # where this tensor's window begins
    row = math.prod(plan.shape[1:])
    for first, end, factor in _row_factors(plan.name, plan.shape[0],
                                           recipe.family_spec.vocab):
        yield from values.chunks(start + first * row, (end - first) * row, std * factor, mean)


def weight_plans(preset: Preset, dtype: str) -> list[TensorPlan]:
    """The checkpoint's tensors in the order the engine's packed layout reads them."""
    shapes = tensor_shapes(preset.recipe)
    layout = expected_tensors(ModelSpec.from_config(preset_config(preset, dtype)))
    if layout != shapes:
        raise RuntimeError(f"preset {preset.name}: the engine would read other tensors than "
                           "the preset's shapes")
    return [TensorPlan(name, TORCH_DTYPES[dtype], shape) for name, shape in layout.items()]


def write_preset(preset: Preset, out: Path, dtype: str,
                 progress: Callable[[int], None] | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``preset`` into ``out`` (created if missing): config, tokenizer and the
    safetensors shards, with an index when there are several. ``progress`` is told of
    every tensor written."""
    out.mkdir(parents=True, exist_ok=True)
    if dtype == FP8:
        _write_fp8(preset, out, progress, max_shard_bytes)
        return
    plans = weight_plans(preset, dtype)
    shards = plan_shards(plans, max_shard_bytes)
    values = PeriodicValues(TORCH_DTYPES[dtype])
    for file, group in shards.items():
        with SafetensorsWriter(out / file, group) as writer:
            for plan in group:
                writer.write_bytes(plan.name, _tensor_chunks(values, preset, plan))
                if progress is not None:
                    progress(1)
    if len(shards) > 1:
        write_json(out / "model.safetensors.index.json", index_json(shards))
    write_text_files(out, preset.recipe, preset_config(preset, dtype))


def _write_fp8(preset: Preset, out: Path, progress: Callable[[int], None] | None,
               max_shard_bytes: int) -> None:
    """``write_preset`` in FP8 (module docstring)."""
    plans = fp8_plans((p.name, p.shape) for p in weight_plans(preset, FLOAT_DTYPE))
    shards = plan_shards(plans, max_shard_bytes)
    floats, codes = PeriodicValues(TORCH_DTYPES[FLOAT_DTYPE]), PeriodicValues(FP8_DTYPE)
    code_scale = FP8_MAX / codes.max_abs  # the sequence as codes: its maximum at 448
    scales = {scale_name(p.name): p for p in plans if is_projection(p.name)}
    for file, group in shards.items():
        with SafetensorsWriter(out / file, group) as writer:
            for plan in group:
                weight = scales.get(plan.name)
                if weight is not None:  # every row back to the projection's std
                    std, _ = value_scale(weight.name, weight.shape, preset.recipe)
                    writer.write(plan.name, torch.full(plan.shape, std / code_scale))
                    continue
                if is_projection(plan.name):
                    chunks = _tensor_chunks(codes, preset, plan, (code_scale, 0.0))
                else:
                    chunks = _tensor_chunks(floats, preset, plan)
                writer.write_bytes(plan.name, chunks)
                if progress is not None:
                    progress(1)
    if len(shards) > 1:
        write_json(out / "model.safetensors.index.json", index_json(shards))
    write_text_files(out, preset.recipe, fp8_config(preset_config(preset, FLOAT_DTYPE)))
