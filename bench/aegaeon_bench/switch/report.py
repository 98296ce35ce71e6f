"""The switch bench's result: per-model rows, the summary figures, the printed tables.

Summary keys (the JSON line): ``load_over_memcpy`` = median over models of
memcpy time / scale-up time (target >= 0.8); ``naive_over_ours`` = median
over models of cold-worker time / scale-up time (target >= 30, the paper's
97% cut is 33x); ``vllm_over_ours`` likewise for a vLLM engine start;
``switch_ms`` / ``switch_ms_prefetch`` per model: the preemptive switch's
critical path without / with prefetch; ``prefetch_hidden_fraction`` = median
over models of 1 - scale-up with prefetch / scale-up without;
``kv_fragmentation`` = mean fragmentation of the unified CPU KV cache during
the mixed-model workload (``kv_fragmentation_max`` its worst sample).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

TARGETS = {"load_over_memcpy": 0.8, "naive_over_ours": 30.0}


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summarize(rows: dict[str, dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """The summary dict (module docstring) over per-model ``rows``, with ``extra`` merged."""
    names = list(rows)

    def ratio(key: str, row: dict[str, Any]) -> float | None:
        value, ours = row.get(key), row["scale_up_ms"]
        return value * 1e3 / ours if value is not None and ours > 0 else None

    for row in rows.values():
        row["naive_over_ours"] = _round(ratio("cold_worker_s", row), 1)
        row["vllm_over_ours"] = _round(ratio("vllm_start_s", row), 1)
        off = row["switch_off"]["scale_up_ms"]
        on = row["switch_on"]["scale_up_ms"]
        row["prefetch_hidden_fraction"] = _round(1.0 - on / off if off else None)
    summary: dict[str, Any] = {
        "load_over_memcpy": _round(_median([rows[n]["load_over_memcpy"] for n in names])),
        "naive_over_ours": _round(_median([rows[n]["naive_over_ours"] for n in names]), 1),
        "vllm_over_ours": _round(_median([rows[n]["vllm_over_ours"] for n in names]), 1),
        "switch_ms": {n: rows[n]["switch_off"]["total_ms"] for n in names},
        "switch_ms_prefetch": {n: rows[n]["switch_on"]["total_ms"] for n in names},
        "prefetch_hidden_fraction": _round(
            _median([rows[n]["prefetch_hidden_fraction"] for n in names])),
        **extra,
    }
    summary["targets"] = dict(TARGETS)
    summary["targets_met"] = {
        key: summary[key] is not None and summary[key] >= target
        for key, target in TARGETS.items()
    }
    summary["models"] = rows
    return summary


def _cell(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_tables(summary: dict[str, Any]) -> None:
    """The human-readable tables of a summary."""
    rows: dict[str, dict[str, Any]] = summary["models"]
    print(f"switch bench: {len(rows)} models, {summary['dtype']}, scale-up = "
          f"ModelSwitcher.activate from the warm Model Cache (median of {summary['repeats']})")
    print(f"{'model':14}{'MB':>8}{'scale-up':>10}{'GB/s':>7}{'memcpy':>9}{'GB/s':>7}"
          f"{'ratio':>7}{'first':>9}{'views':>7}{'cold s':>8}{'vLLM s':>8}{'HF s':>7}"
          f"{'naive/us':>10}")
    for name, r in rows.items():
        print(f"{name:14}{r['nbytes'] / 1e6:8.1f}{r['scale_up_ms']:10.2f}{r['scale_up_gb_s']:7.2f}"
              f"{r['memcpy_ms']:9.2f}{r['memcpy_gb_s']:7.2f}{r['load_over_memcpy']:7.2f}"
              f"{r['first_scale_up_ms']:9.2f}{r['bind_ms']:7.2f}{_cell(r.get('cold_worker_s'), 8)}"
              f"{_cell(r.get('vllm_start_s'), 8, 1)}{_cell(r.get('transformers_s'), 7)}"
              f"{_cell(r.get('naive_over_ours'), 10, 1)}")
    print("(ms unless marked; ratio = memcpy / scale-up; first = the model's first scale-up in "
          "the worker; views = building its weight views, kept across switches; "
          "naive/us = cold worker / scale-up)")
    print()
    print(f"preemptive switch ({summary['batch']} requests x {summary['context']} tokens of KV "
          f"each way, decode slice {summary['slice_ms']:.0f} ms), ms, prefetch off | on:")
    print(f"{'A -> B':30}{'KV MB':>7}{'swap-out':>9}{'scale-up':>10}{'swap-in':>9}"
          f"{'total':>9}{' |':>3}{'scale-up':>10}{'total':>9}{'hidden':>8}{'A step':>8}"
          f"{'+pf':>8}")
    for name, r in rows.items():
        off, on = r["switch_off"], r["switch_on"]
        pair = f"{r['switch_from']} -> {name}"
        print(f"{pair:30}{r['kv_batch_bytes'] / 1e6:7.1f}{off['swap_out_ms']:9.2f}"
              f"{off['scale_up_ms']:10.2f}{off['swap_in_ms']:9.2f}{off['total_ms']:9.2f}{' |':>3}"
              f"{on['scale_up_ms']:10.2f}{on['total_ms']:9.2f}"
              f"{_cell(r['prefetch_hidden_fraction'], 8)}{_cell(off['decode_step_ms'], 8)}"
              f"{_cell(on['decode_step_overlap_ms'], 8)}")
    print("(swap-out = enqueueing it, its copy runs concurrently; swap-in = its share of the "
          "critical path, it overlaps the scale-up; hidden = share of the scale-up hidden by "
          "prefetch; A step / +pf = a decode step of A, the model switched FROM, alone / "
          "while B's prefetch copy ran: a row's step is not B's)")
    print()
    for key in ("load_over_memcpy", "naive_over_ours"):
        met = "met" if summary["targets_met"][key] else "NOT met"
        print(f"{key}: {summary[key]} (target >= {TARGETS[key]}: {met})")
    for key in ("vllm_over_ours", "prefetch_hidden_fraction", "kv_fragmentation",
                "kv_fragmentation_max", "check"):
        print(f"{key}: {summary.get(key)}")
