"""How `bench serve` shows its results: a short table for people, a JSON line for scripts."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, TextIO

from aegaeon_workload.trace import plain_json


def _num(value: Any, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:.{digits}f}{unit}"


def format_table(result: Mapping[str, Any], per_model: Mapping[str, Mapping[str, Any]]) -> str:
    """The run's headline numbers and one line per model."""
    prefetched = result.get("prefetched_switches")
    switches = f"{result['switches']}" + (f" ({prefetched} prefetched)" if prefetched else "")
    ttft = f"TTFT p50 {_num(result['ttft_p50'], ' s')}  p99 {_num(result['ttft_p99'], ' s')}"
    tbt_p50 = _num(result["tbt_p50"], " ms", 1e3, 1)
    tbt = f"TBT p50 {tbt_p50}  p99 {_num(result['tbt_p99'], ' ms', 1e3, 1)}"
    lines = [
        f"SLO attainment {_num(result['slo_attainment'], '%', 100, 1)} "
        f"(TTFT {result['ttft_s']:g} s, TBT {result['tbt_s']:g} s; "
        f"{result['tokens_met']}/{result['tokens_expected']} tokens on time), "
        f"artifact qos {_num(result['qos'])}",
        f"requests {result['requests']}: completed {result['completed']}, "
        f"failed {result['failed']}; model switches {switches}",
        f"{ttft}   {tbt}",
    ]
    if per_model:
        width = max(len(m) for m in per_model)
        lines.append(f"{'model':<{width}}  reqs  fail  attain  ttft_p50   tbt_p50")
        for model, m in per_model.items():
            lines.append(f"{model:<{width}}  {m['requests']:>4}  {m['failed']:>4}  "
                         f"{_num(m['slo_attainment'], '%', 100, 1):>6}  "
                         f"{_num(m['ttft_p50'], ' s'):>8}  {_num(m['tbt_p50'], ' ms', 1e3, 1):>8}")
    return "\n".join(lines)


def print_result(result: Mapping[str, Any], per_model: Mapping[str, Mapping[str, Any]], *,
                 as_json: bool, out: TextIO) -> None:  # fmt: skip
    """The table, then (``as_json``) the result as the last line: one JSON object."""
    print(format_table(result, per_model), file=out)
    if as_json:
        print(json.dumps(plain_json(dict(result))), file=out, flush=True)
