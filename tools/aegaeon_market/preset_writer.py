"""Write a preset's model directory at the speed of the disk, or its recipe alone.

Drawing billions of normal values would take minutes; measuring speed and
switching needs the real shapes and bytes, and values that keep activations
finite and greedy text varied. So every tensor is a window of one seeded
periodic sequence of standard normal draws, scaled as the market's own models
are (``aegaeon_engine.random_weights``, which the Model Cache shares to
generate an in-memory entry at load). The period is prime, so the rows of any
matrix start at distinct offsets of it and no two rows are equal. Each scale
is applied once, in the stored dtype, to a buffer holding the sequence twice;
a tensor is then written as slices of that buffer straight into its
safetensors file: no tensor of its size is built and nothing is written
twice. Embedding and output rows of ids that name no token (a released
vocabulary is larger than the tokenizer trained here) get a tenth of the
scale, so sampled tokens stay within the tokenizer.

An in-memory entry (`write_recipe`) gets the same config and tokenizer files
and a ``random-weights.json`` instead of its shards: the Model Cache generates
the bytes those shards would hold when it loads the model.

In FP8 (fp8_out.py) the projections are windows of the same sequence, as e4m3
codes: the sequence scaled so its largest magnitude is 448, once, and every row
of a projection gets the scale that brings it back to the projection's
standard deviation (no row of a window exceeds the sequence's maximum), so an
FP8 preset is written as fast as a bfloat16 one and dequantizes to nearly its
values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from aegaeon_common.dtypes import FP8_MAX
from aegaeon_engine.fp8 import FP8_DTYPE
from aegaeon_engine.loader import scale_name
from aegaeon_engine.random_weights import PeriodicValues, RandomWeights, tensor_windows
from aegaeon_engine.spec import FP8, ModelSpec
from aegaeon_engine.weights import TORCH_DTYPES

from aegaeon_market.fp8_out import FLOAT_DTYPE, fp8_config, fp8_plans, is_projection
from aegaeon_market.model_files import expected_tensors
from aegaeon_market.presets import Preset, preset_config
from aegaeon_market.safetensors_out import SafetensorsWriter, TensorPlan, index_json, plan_shards
from aegaeon_market.shapes import tensor_shapes
from aegaeon_market.weights import value_scale
from aegaeon_market.writer import write_json, write_text_files

SEED = 0
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB")


def random_weights(preset: Preset, dtype: str, seed: int) -> RandomWeights:
    """The recipe of ``preset``'s weights in ``dtype`` with ``seed``."""
    vocab = preset.recipe.family_spec.vocab
    return RandomWeights(preset.name, dtype, seed, tuple(vocab.token_id_ranges))


def _tensor_chunks(values: PeriodicValues, preset: Preset, plan: TensorPlan, seed: int,
                   std_mean: tuple[float, float] | None = None) -> Iterator[memoryview]:
    """The bytes of ``plan``'s tensor; ``std_mean``: that scale instead of its own."""
    scale = std_mean or value_scale(plan.name, plan.shape, preset.recipe)
    ranges = preset.recipe.family_spec.vocab.token_id_ranges
    for window in tensor_windows(values, preset.name, seed, plan.name, plan.shape, scale,
                                 ranges):  # fmt: skip
        yield window.numpy().data


def weight_plans(preset: Preset, dtype: str) -> list[TensorPlan]:
    """The checkpoint's tensors in the order the engine's packed layout reads them."""
    shapes = tensor_shapes(preset.recipe)
    layout = expected_tensors(ModelSpec.from_config(preset_config(preset, dtype)))
    if layout != shapes:
        raise RuntimeError(f"preset {preset.name}: the engine would read other tensors than "
                           "the preset's shapes")
    return [TensorPlan(name, TORCH_DTYPES[dtype], shape) for name, shape in layout.items()]


def write_recipe(preset: Preset, out: Path, dtype: str, seed: int) -> RandomWeights:
    """An in-memory entry of ``preset`` in ``out`` (created if missing): its config and
    tokenizer files and ``random-weights.json``, no weights."""
    out.mkdir(parents=True, exist_ok=True)
    recipe = random_weights(preset, dtype, seed)
    base = preset_config(preset, FLOAT_DTYPE if dtype == FP8 else dtype)
    write_text_files(out, preset.recipe, fp8_config(base) if dtype == FP8 else base)
    recipe.write(out)
    return recipe


def write_preset(preset: Preset, out: Path, dtype: str,
                 progress: Callable[[int], None] | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, seed: int = SEED) -> None:
    """Write ``preset`` into ``out`` (created if missing): config, tokenizer and the
    safetensors shards, with an index when there are several. ``progress`` is told of
    every tensor written. ``seed`` 0 is what random presets always were. In FP8 the
    projections are codes with per-row scales (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    fp8 = dtype == FP8
    float_dtype = FLOAT_DTYPE if fp8 else dtype
    plans = weight_plans(preset, float_dtype)
    if fp8:
        plans = fp8_plans((p.name, p.shape) for p in plans)
    shards = plan_shards(plans, max_shard_bytes)
    floats = PeriodicValues(TORCH_DTYPES[float_dtype], seed)
    codes = PeriodicValues(FP8_DTYPE, seed) if fp8 else floats
    code_scale = FP8_MAX / codes.max_abs  # the sequence as codes: its maximum at 448
    scales = {scale_name(p.name): p for p in plans if fp8 and is_projection(p.name)}
    for file, group in shards.items():
        with SafetensorsWriter(out / file, group) as writer:
            for plan in group:
                weight = scales.get(plan.name)
                if weight is not None:  # every row back to the projection's std
                    std, _ = value_scale(weight.name, weight.shape, preset.recipe)
                    writer.write(plan.name, torch.full(plan.shape, std / code_scale))
                    continue
                if fp8 and is_projection(plan.name):
                    chunks = _tensor_chunks(codes, preset, plan, seed, (code_scale, 0.0))
                else:
                    chunks = _tensor_chunks(floats, preset, plan, seed)
                writer.write_bytes(plan.name, chunks)
                if progress is not None:
                    progress(1)
    if len(shards) > 1:
        write_json(out / "model.safetensors.index.json", index_json(shards))
    config = preset_config(preset, float_dtype)
    write_text_files(out, preset.recipe, fp8_config(config) if fp8 else config)
