"""``scripts/gpu-check``'s ``fp8_switch`` step: an 8B model in FP8, switched in on the GPU.

Two commands (``Check.fp8_switch``): ``python -m aegaeon_bench.gpu_check.fp8 --market M
--small DIR`` writes ``llama-3.1-8b`` with random weights in FP8 (``market add
--random llama-3.1-8b --dtype fp8``; ``--tiny``: shrunk to two narrow layers, the
dry run) into a market of its own, ``M`` (the check's market and the serving steps
stay as they are), beside a copy of the check market's smallest model ``DIR``, and
prints, as its last line, the models, the FP8 one's packed bytes and those of the
same preset in bfloat16 (from the layout alone: nothing of 16 GB is written); then
``aegaeon bench switch --device cuda --market M --models <it>,<the small one>
--no-cold --no-vllm --no-transformers --json`` as the ``bench_switch`` step runs it.
``summarize`` turns the two into the step's result:

- ``wake_to_first_token_s``: the preemptive switch into the FP8 model with prefetch
  off (swap-out of the small model's batch, scale-up of the FP8 model from the warm
  Model Cache, swap-in of its batch: ``switch_ms``) plus one decode step of the FP8
  model's batch (the steps it decodes before switching back out), against
  ``TARGET_S`` (issue 27: 0.2 s on an H100);
- ``bytes_moved`` (its scale-up's bytes), ``bf16_bytes`` and their ratio;
- the scale-up alone and its copy rate.

Standard library only at the top: the check imports this module before the carried
wheels are installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PRESET = "llama-3.1-8b"
MODEL = f"{PRESET}-fp8"
TARGET_S = 0.2


def switch_argv(python: str, market: Path, device: str, *models: str, dry: bool) -> list[str]:
    """The ``aegaeon bench switch`` command of the check's ``bench_switch`` step and of this
    one (``models``: the FP8 one and the small one)."""
    size = (("--repeats", "1", "--switch-repeats", "1", "--kv-ops", "50", "--slice-ms", "20")
            if dry else ("--repeats", "5", "--switch-repeats", "2"))
    return [python, "-m", "aegaeon_cli.main", "bench", "switch", "--device", device,
            "--market", str(market), "--models", ",".join(models), "--no-cold",
            "--no-vllm", "--no-transformers", "--json", *size]


def build_argv(python: str, market: Path, small: Path, dry: bool) -> list[str]:
    """The command that writes the FP8 model and copies ``small`` beside it (``main``)."""
    return [python, "-m", "aegaeon_bench.gpu_check.fp8", "--market", str(market),
            "--small", str(small), *(("--tiny",) if dry else ())]


def summarize(built: dict[str, Any], switch: dict[str, Any]) -> dict[str, Any]:
    """The step's result from ``main``'s line (``built``) and bench switch's JSON."""
    name = built["model"]
    rows: dict[str, Any] = switch.get("models") or {}
    row, others = rows.get(name), [r for n, r in rows.items() if n != name]
    if row is None or not others:
        raise ValueError(f"bench switch measured no switch into {name!r} and back")
    switch_ms = row["switch_off"]["total_ms"]
    # the other model's switches started from the FP8 model: its decode steps before them
    step_ms = others[0]["switch_off"].get("decode_step_ms")
    wake_s = (switch_ms + (step_ms or 0.0)) / 1e3
    moved, bf16 = int(row["nbytes"]), int(built["bf16_bytes"])
    return {
        "model": name, "preset": built["preset"], "device": switch.get("device"),
        "device_name": switch.get("device_name"),
        "wake_to_first_token_s": round(wake_s, 4), "target_s": TARGET_S,
        "target_met": wake_s <= TARGET_S,
        "switch_ms": switch_ms, "decode_step_ms": step_ms,
        "scale_up_ms": row["scale_up_ms"], "scale_up_gb_s": row.get("scale_up_gb_s"),
        "switch_ms_prefetch": row["switch_on"]["total_ms"],
        "bytes_moved": moved, "bf16_bytes": bf16,
        "bytes_over_bf16": round(moved / bf16, 4) if bf16 else None,
        "check": switch.get("check"), "write_s": built.get("write_s"),
    }  # fmt: skip


def smallest_model(models: Sequence[dict[str, Any]]) -> str:
    """The name of the market's smallest model (``market_models`` rows)."""
    if not models:
        raise ValueError("the market has no model to switch against")
    return str(min(models, key=lambda m: int(m["params"]))["name"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check_fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--market", type=Path, required=True, help="the step's own market")
    parser.add_argument("--small", type=Path, required=True,
                        help="a small model's directory, copied into the market")
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--tiny", action="store_true", help="two narrow layers (dry run)")
    args = parser.parse_args(argv)

    from aegaeon_engine import ModelSpec, weight_layout
    from aegaeon_market.edit import add_model, add_random
    from aegaeon_market.presets import preset_config, preset_named

    from aegaeon_bench.gpu_check.models import tiny_preset

    preset = preset_named(args.preset)
    if args.tiny:
        preset = tiny_preset(preset)
    name = f"{args.preset}-fp8"
    start = time.perf_counter()
    entry = add_random(args.market, preset, name, "fp8", replace_existing=True, progress=False)
    write_s = time.perf_counter() - start
    small = add_model(args.market, args.small, args.small.name, replace_existing=True,
                      progress=False)
    fp8_bytes = weight_layout(ModelSpec.from_dir(entry.path), "bfloat16").total_bytes
    bf16_spec = ModelSpec.from_config(preset_config(preset, "bfloat16"))
    bf16_bytes = weight_layout(bf16_spec, "bfloat16").total_bytes
    print(json.dumps({"model": name, "small_model": small.name, "preset": args.preset,
                      "tiny": args.tiny,
                      "fp8_bytes": fp8_bytes, "bf16_bytes": bf16_bytes,
                      "write_s": round(write_s, 2),
                      "params": int(entry.params)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
