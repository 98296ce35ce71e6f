"""``scripts/gpu-check``'s ``fp8_switch`` step, its pure parts (gpu_check_fp8): the commands
it runs and what it makes of bench switch's JSON. (``--dry-run --steps fp8_switch``
runs the whole step on the CPU.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aegaeon_bench.gpu_check.fp8 import (
    MODEL,
    TARGET_S,
    build_argv,
    smallest_model,
    summarize,
    switch_argv,
)
from aegaeon_bench.gpu_check.report import step_highlights


def test_fp8_switch_commands() -> None:
    market, small = Path("/w/fp8-market"), Path("/w/market/llama-gqa-5m")
    assert build_argv("py", market, small, dry=False) == [
        "py", "-m", "aegaeon_bench.gpu_check.fp8", "--market", "/w/fp8-market",
        "--small", "/w/market/llama-gqa-5m"]
    assert build_argv("py", market, small, dry=True)[-1] == "--tiny"
    argv = switch_argv("py", market, "cuda", MODEL, "llama-gqa-5m", dry=False)
    assert argv[:5] == ["py", "-m", "aegaeon_cli.main", "bench", "switch"]
    flags = argv[5:]
    assert flags[flags.index("--device") + 1] == "cuda"
    assert flags[flags.index("--market") + 1] == "/w/fp8-market"
    assert flags[flags.index("--models") + 1] == f"{MODEL},llama-gqa-5m"
    for flag in ("--no-cold", "--no-vllm", "--no-transformers", "--json"):
        assert flag in flags
    assert "--slice-ms" in switch_argv("py", market, "cpu", MODEL, "s", dry=True)


def test_smallest_model() -> None:
    rows = [{"name": "b", "params": 20}, {"name": "a", "params": 5}, {"name": "c", "params": 9}]
    assert smallest_model(rows) == "a"
    with pytest.raises(ValueError, match="no model"):
        smallest_model([])


def _switch_json(switch_ms: float, step_ms: float) -> dict[str, Any]:
    def row(nbytes: int, total_ms: float, decode_step_ms: float | None) -> dict[str, Any]:
        return {"nbytes": nbytes, "scale_up_ms": total_ms / 2, "scale_up_gb_s": 40.0,
                "switch_off": {"total_ms": total_ms, "decode_step_ms": decode_step_ms},
                "switch_on": {"total_ms": total_ms / 3, "decode_step_ms": decode_step_ms}}

    # the small model's switches start from the FP8 one: its decode steps are the FP8 model's
    return {"device": "cuda", "check": {"bytes_equal": True, "tokens_equal": True},
            "models": {MODEL: row(9_100_000_000, switch_ms, 3.0),
                       "small": row(10_000_000, 2.0, step_ms)}}


def test_fp8_switch_summary() -> None:
    built = {"model": MODEL, "small_model": "small", "preset": "llama-3.1-8b",
             "fp8_bytes": 9_100_000_000, "bf16_bytes": 16_060_000_000, "write_s": 12.0}
    out = summarize(built, _switch_json(switch_ms=180.0, step_ms=15.0))
    assert out["wake_to_first_token_s"] == pytest.approx(0.195)
    assert out["target_s"] == TARGET_S and out["target_met"] is True
    assert (out["bytes_moved"], out["bf16_bytes"]) == (9_100_000_000, 16_060_000_000)
    assert out["bytes_over_bf16"] == pytest.approx(0.5666, abs=1e-4)
    assert out["scale_up_ms"] == 90.0 and out["switch_ms_prefetch"] == 60.0
    slow = summarize(built, _switch_json(switch_ms=190.0, step_ms=15.0))
    assert slow["target_met"] is False
    highlights = step_highlights("fp8_switch", slow)
    assert highlights["wake_to_first_token_s"] == pytest.approx(0.205)
    with pytest.raises(ValueError, match="no switch into"):
        summarize(built, {"models": {"small": {}}})
