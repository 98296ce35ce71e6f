"""The engine scenario's plan: models, batches and contexts (gpu_check.engine measures it).

Standard library only: the check's planner imports this before the carried wheels are
installed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

BIG = (("llama-3.1-8b", "bfloat16"), ("llama-3.1-8b", "fp8"), ("llama-3.2-3b", "bfloat16"))
SMALL = ("qwen2.5-0.5b", "bfloat16")
BATCHES = (1, 8, 32)
MIXED = "mixed"
GREEDY_BATCH, GREEDY_TOKENS = 8, 16
# the bounds (mixed contexts): step over roofline, FP8 b1 ms, small after big, wake
ROOFLINE_BOUNDS = {"llama-3.1-8b": 1.3, "llama-3.2-3b": 1.5}
FP8_B1_MS, SMALL_AFTER_RATIO, WAKE_S = 4.0, 1.2, 0.2
TINY_WINDOW = 512
# the dry run's vocabulary: its prompts are ids below 1,005 (nothing is tokenized), and at
# a released vocabulary (128k-152k ids) the logits were most of a tiny model's step
TINY_VOCAB = 2048


@dataclass(frozen=True)
class Plan:
    """What one run measures (the dry run: the same, scaled)."""

    tiny: bool
    contexts: tuple[int, int]  # the two equal-length contexts
    mixed: tuple[int, int]  # a mixed batch's shortest and longest context
    prefill_len: int
    steps: int  # timed decode steps per shape
    peer_steps: int
    peer_repeats: int  # the peer's timed generates of each length (the median)

    @classmethod
    def of(cls, tiny: bool) -> Plan:
        if tiny:  # what runs is checked, not its numbers: one timed step or generate each
            return cls(True, (64, 256), (16, 256), 256, 1, 1, 1)
        return cls(False, (512, 2048), (128, 2048), 2048, 10, 8, 2)

    def context_lists(self, batch: int) -> dict[str, list[int]]:
        """Each shape's contexts for ``batch`` sequences, by name (``512``, ..., ``mixed``)."""
        low, high = self.mixed
        mixed = ([round((low + high) / 2)] if batch == 1 else
                 [round(low + (high - low) * i / (batch - 1)) for i in range(batch)])
        return {**{str(c): [c] * batch for c in self.contexts}, MIXED: mixed}


def preset_bf16_config(preset_name: str, tiny: bool) -> dict[str, Any]:
    """A market preset's bf16 ``config.json`` (``market add --random``'s); ``tiny``: the
    dry run's, two narrow layers (``tiny_preset``) over ``TINY_VOCAB`` ids."""
    from aegaeon_market.presets import preset_config, preset_named

    from aegaeon_bench.gpu_check.models import tiny_preset

    preset = preset_named(preset_name)
    if not tiny:
        return preset_config(preset, "bfloat16")
    return {**preset_config(tiny_preset(preset), "bfloat16"), "vocab_size": TINY_VOCAB}


def model_spec(preset_name: str, dtype: str, tiny: bool) -> Any:
    """The engine's spec of a market preset (``preset_bf16_config``)."""
    from aegaeon_engine import ModelSpec
    from aegaeon_market.fp8_out import fp8_config

    config = preset_bf16_config(preset_name, tiny)
    spec = ModelSpec.from_config(fp8_config(config) if dtype == "fp8" else config,
                                 name=f"{preset_name}-{dtype}")
    # the dry run's window: its contexts (a graph's static block table spans the window)
    return replace(spec, max_model_len=TINY_WINDOW) if tiny else spec
