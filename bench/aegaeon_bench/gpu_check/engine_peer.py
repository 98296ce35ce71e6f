"""The engine scenario's peer: transformers on the same GPU, the same shapes (gpu_check.engine).

For each bf16 model: transformers' model of the same config (random weights, made
on the device), the same batch sizes and contexts as ours (mixed lengths
left-padded with an attention mask, as a transformers user batches them).
Decode tokens/s from ``generate``: the time of ``1 + n`` new tokens less that of
one (the prefill), over ``n`` steps. ``mode`` per shape: ``static+compile`` (its
static cache, which ``generate`` compiles with ``torch.compile``) for llama-3.1-8b
bf16's mixed batches of 8 and 1 while the budget leaves room for compiling (each
batch size compiles anew); ``eager-sdpa`` (its dynamic cache and SDPA) otherwise;
``skipped`` past the deadline. Mixed contexts first: the bounds are on them. The FP8 model has no
transformers FP8 path here: its peer is its preset's bf16 model (``peer_of``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

from aegaeon_bench.gpu_check.engine_plan import BATCHES, MIXED, Plan, preset_bf16_config

COMPILE_RESERVE_S = 90.0  # a compile of an 8B model's decode step, with room after it
COMPILED_BATCHES = (8, 1)
EAGER_RESERVE_S = 10.0
NEXT_MODEL_S = 40.0  # kept for the next model's mixed shapes


def hf_model(preset: str, tiny: bool, device: str) -> Any:
    """transformers' model of ``preset``'s config (bf16, random weights) on ``device``."""
    import torch
    import transformers

    config = preset_bf16_config(preset, tiny)
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    hf_config._attn_implementation = "sdpa"
    auto: Any = transformers.AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(hf_config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def _batch(contexts: list[int], device: str) -> tuple[Any, Any]:
    """Left-padded prompts of these lengths and their attention mask."""
    import torch

    width = max(contexts)
    ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, n in enumerate(contexts):
        ids[i, width - n:] = torch.arange(n) % 1000 + 5
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


def decode_tok_s(model: Any, contexts: list[int], steps: int, static: bool,
                 device: str, repeats: int = 2) -> float:
    """Decode tokens/s of ``generate`` on these contexts (module docstring): medians of
    ``repeats`` timed generates, after a warm-up."""
    import torch

    ids, mask = _batch(contexts, device)
    extra = {"cache_implementation": "static"} if static else {}

    def gen(new: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, **extra)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    gen(steps + 1)  # warm-up (and the compile, with the static cache)
    prefill = statistics.median(gen(1) for _ in range(repeats))
    whole = statistics.median(gen(steps + 1) for _ in range(repeats))
    return len(contexts) * steps / max(whole - prefill, 1e-9)


def _jobs(plan: Plan) -> list[tuple[int, str, list[int]]]:
    """A model's shapes, the mixed contexts first (the bounds are on them)."""
    first = [(b, MIXED, plan.context_lists(b)[MIXED]) for b in BATCHES]
    rest = [(b, shape, ctx) for b in BATCHES for shape, ctx in plan.context_lists(b).items()
            if shape != MIXED]
    return first + rest


def peer_results(device: str, plan: Plan, specs: Mapping[str, Any],
                 ours: Mapping[str, Any], deadline: float, compile_: bool) -> dict[str, Any]:
    """Per model of ``ours``: transformers' decode tokens/s per shape, which mode ran, and
    ours over theirs per batch size (mixed contexts). The first model's mixed shapes of
    ``COMPILED_BATCHES`` run its static cache compiled while time allows; a model's
    other shapes leave ``NEXT_MODEL_S`` to the models after it."""
    import torch

    out: dict[str, Any] = {}
    measured: dict[str, dict[str, Any]] = {}  # preset -> shapes
    presets = [k.rsplit("-", 1)[0] for k in ours if not k.endswith("-fp8")]
    for key in ours:
        preset, dtype = key.rsplit("-", 1)
        if dtype == "fp8":
            continue
        shapes: dict[str, Any] = {}
        model = None
        last = preset == presets[-1]
        try:
            model = hf_model(preset, plan.tiny, device)
            for batch, shape, contexts in _jobs(plan):
                left = deadline - time.monotonic()
                keep = 0.0 if last or shape == MIXED else NEXT_MODEL_S
                if left - keep < EAGER_RESERVE_S:
                    shapes[f"b{batch}_{shape}"] = {"mode": "skipped", "why": "out of time"}
                    continue
                static = (compile_ and preset == presets[0] and shape == MIXED
                          and batch in COMPILED_BATCHES and left > COMPILE_RESERVE_S)
                tok_s = decode_tok_s(model, contexts, plan.peer_steps, static, device,
                                     plan.peer_repeats)
                shapes[f"b{batch}_{shape}"] = {
                    "mode": "static+compile" if static else "eager-sdpa",
                    "decode_tok_s": round(tok_s, 2)}
        except (RuntimeError, ValueError, TypeError) as exc:  # a peer that fails is reported
            shapes["error"] = f"{type(exc).__name__}: {exc}"[-800:]
        finally:
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        measured[preset] = shapes
        out[key] = {"peer_of": key, "shapes": shapes,
                    "ours_over_peer": _ratios(ours[key], shapes)}
    for key in ours:
        preset, dtype = key.rsplit("-", 1)
        if dtype == "fp8":
            peer = measured.get(preset)
            out[key] = ({"peer_of": f"{preset}-bfloat16", "shapes": peer,
                         "ours_over_peer": _ratios(ours[key], peer)} if peer is not None
                        else {"peer_of": None, "why": "no bf16 peer of its preset measured"})
    return out


def _ratios(ours: Mapping[str, Any], shapes: Mapping[str, Any]) -> dict[str, float | None]:
    """Ours over the peer in decode tokens/s, per batch size, mixed contexts."""
    ratios: dict[str, float | None] = {}
    for batch in BATCHES:
        key = f"b{batch}_mixed"
        theirs = (shapes.get(key) or {}).get("decode_tok_s")
        mine = (ours.get("decode", {}).get(key) or {}).get("tok_s")
        ratios[f"b{batch}"] = round(mine / theirs, 4) if mine and theirs else None
    return ratios
