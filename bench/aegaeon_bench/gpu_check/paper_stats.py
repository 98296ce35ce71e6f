"""The numbers of ``scripts/gpu-check --scenario paper``: what a run measured, the
sustainable rate per policy and their ratio (the rates to try: ``paper_plan``).

Pure functions over plain values and a run's files (``bench serve --trace``:
``TRACE.summary.json``, ``TRACE.stats.json``, ``TRACE.kv.jsonl``). The
services' switch and turn records are cumulative over a node's life, so a
run's are those stamped inside its window (the summary's ``start_s`` ..
``end_s``). Standard library only, like the rest of gpu-check.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TARGET = 0.9


# ---- the sustainable rate and the ratio --------------------------------------------------
def sustainable_rate(points: Sequence[tuple[float, float]], target: float = TARGET
                     ) -> dict[str, Any]:
    """The rate at which attainment first falls to ``target``, linearly interpolated
    between the last rate that held it and the first that did not (as
    ``aegaeon_sim.figures.crossing_at``, which bench may not import). ``kind``:
    ``interpolated``; ``at_least`` (every rate held: the highest tried); ``below``
    (the lowest rate tried already missed: ``upper_bound``); null without points."""
    ordered = sorted(points)
    if not ordered:
        return {"rps_per_model": None, "kind": None, "reason": "no run measured attainment"}
    if ordered[0][1] < target:
        return {"rps_per_model": None, "kind": "below", "upper_bound": ordered[0][0],
                "reason": f"under {target:.0%} already at the lowest rate tried "
                          f"({ordered[0][0]:.4g} per model)"}  # fmt: skip
    for (r0, a0), (r1, a1) in itertools.pairwise(ordered):
        if a1 < target:
            x = r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
            return {"rps_per_model": x, "kind": "interpolated", "between": [r0, r1]}
    top = ordered[-1][0]
    return {"rps_per_model": top, "kind": "at_least",
            "reason": f"{target:.0%} or more at every rate tried (up to {top:.4g} per model)"}


def _interval(rate: Mapping[str, Any]) -> tuple[float, float] | None:
    kind = rate.get("kind")
    if kind == "interpolated":
        return float(rate["rps_per_model"]), float(rate["rps_per_model"])
    if kind == "at_least":
        return float(rate["rps_per_model"]), math.inf
    if kind == "below":
        return 0.0, float(rate["upper_bound"])
    return None


def rate_ratio(ours: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``ours / base`` of two :func:`sustainable_rate` answers: a value when both were
    interpolated, a bound (``at_least``/``at_most``) when one end is open, else null."""
    a, b = _interval(ours), _interval(base)
    if a is None or b is None:
        return {"value": None, "kind": None, "reason": "a policy has no sustainable rate"}
    low = a[0] / b[1] if b[1] > 0 else math.inf
    high = a[1] / b[0] if b[0] > 0 else math.inf
    if low == high:
        return {"value": low, "kind": "exact"}
    if low > 0 and math.isfinite(low):
        return {"value": low, "kind": "at_least",
                "reason": "one policy's rate is a bound (see sustainable)"}
    if math.isfinite(high):
        return {"value": high, "kind": "at_most",
                "reason": "one policy's rate is a bound (see sustainable)"}
    return {"value": None, "kind": None, "reason": "both rates are open bounds"}


# ---- what one run measured ------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _in_window(records: Sequence[Mapping[str, Any]], key: str, start_s: float,
               end_s: float) -> list[Mapping[str, Any]]:
    return [r for r in records if start_s <= float(r.get(key) or 0.0) <= end_s]


def run_files(trace: Path) -> dict[str, Any]:
    """A run's summary, final stats and KV samples (each None/[] when missing)."""
    return {"summary": _read_json(Path(f"{trace}.summary.json")),
            "stats": _read_json(Path(f"{trace}.stats.json")),
            "kv": _read_jsonl(Path(f"{trace}.kv.jsonl")),
            "trace": _read_jsonl(trace)}  # fmt: skip


def engine_costs(files: Mapping[str, Any]) -> dict[str, Any]:
    """Per model, from the request timings inside the run's window: the median engine
    seconds per decode step (a request's decode time over its tokens after the first)
    and per prompt token (its prefill compute over the trace's prompt length). ``*``:
    the node's, for models no finished request measured: the median of the decode turns
    in the window (engine time over steps) and the instances' prefill counters."""
    summary, stats = files.get("summary") or {}, files.get("stats") or {}
    start_s, end_s = float(summary.get("start_s", 0.0)), float(summary.get("end_s", math.inf))
    prompts = {str(r.get("server_id")): int(r.get("prompt_tokens") or 0)
               for r in files.get("trace") or []}  # fmt: skip
    steps: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    for timing in _in_window(stats.get("timings") or [], "arrival_s", start_s, end_s):
        model = str(timing["model"])
        if int(timing.get("num_tokens") or 0) > 1 and timing.get("decode_s"):
            steps.setdefault(model, []).append(
                float(timing["decode_s"]) / (int(timing["num_tokens"]) - 1))
        tokens = prompts.get(str(timing.get("request_id")), 0)
        compute = (timing.get("extra") or {}).get("prefill_compute_s")
        if tokens > 0 and compute:
            prefill.setdefault(model, []).append(float(compute) / tokens)
    models = sorted(set(steps) | set(prefill))
    out: dict[str, Any] = {
        m: {"decode_s_per_step": _median(steps.get(m, [])),
            "prefill_s_per_token": _median(prefill.get(m, [])),
            "requests": max(len(steps.get(m, [])), len(prefill.get(m, [])))}
        for m in models
    }  # fmt: skip
    turns = [float(t["engine_s"]) / int(t["steps"])
             for t in _in_window(stats.get("turns") or [], "start_s", start_s, end_s)
             if t.get("steps")]  # fmt: skip
    counters = [(i or {}).get("counters") or {}
                for i in (stats.get("instance_stats") or {}).values()]  # fmt: skip
    prefill_tokens = sum(float(c.get("prefill_tokens") or 0.0) for c in counters)
    prefill_s = sum(float(c.get("prefill_s") or 0.0) for c in counters)
    out["*"] = {"decode_s_per_step": _median(turns),
                "prefill_s_per_token": prefill_s / prefill_tokens if prefill_tokens else None,
                "turns": len(turns)}  # fmt: skip
    return out


def capacity_unit(costs: Mapping[str, Mapping[str, Any]], mean_prompt: float,
                  mean_output: float, num_models: int, num_instances: int) -> float | None:
    """Requests/s per model at which ``num_instances`` instances serving one request at a
    time would be busy all the time: ``num_instances / (num_models * T)``, ``T`` the mean
    over the measured models of prefill + decode of a mean request (a model's missing
    cost: the node's, ``*``; null without any measured decode step)."""
    node = costs.get("*") or {}
    times = []
    for model, cost in costs.items():
        if model == "*":
            continue
        step = cost.get("decode_s_per_step") or node.get("decode_s_per_step")
        token = cost.get("prefill_s_per_token") or node.get("prefill_s_per_token")
        if step is not None:
            times.append((token or 0.0) * mean_prompt + step * mean_output)
    if not times and node.get("decode_s_per_step") is not None:
        token = node.get("prefill_s_per_token") or 0.0
        times.append(token * mean_prompt + node["decode_s_per_step"] * mean_output)
    if not times or num_models <= 0:
        return None
    return num_instances / (num_models * statistics.fmean(times))


def switch_numbers(files: Mapping[str, Any], model_bytes: Mapping[str, int],
                   num_instances: int) -> dict[str, Any]:
    """The run's switches and what they cost the instances: the records in its window
    (``total_s``: how long the instance waited on the switch, its visible time; a
    prefetched model is copied ahead and waits only for the rest), the copy rate of the
    switches that loaded a model, and the visible time's share of the instances' time."""
    summary, stats = files.get("summary") or {}, files.get("stats") or {}
    start_s, end_s = float(summary.get("start_s", 0.0)), float(summary.get("end_s", 0.0))
    records = _in_window(stats.get("switches") or [], "at_s", start_s, end_s)
    visible = [float(r.get("total_s") or 0.0) for r in records]
    loads = [(model_bytes.get(str(r.get("to_model")), 0), float(r.get("load_s") or 0.0))
             for r in records if not r.get("prefetched")]
    load_s = sum(s for b, s in loads if b > 0)
    wall_s = max(end_s - start_s, 1e-9)
    charged = [float(r.get("charged_s") or 0.0) for r in records]
    return {
        "records": len(records),
        "prefetched": sum(bool(r.get("prefetched")) for r in records),
        "resident": sum(bool(r.get("resident")) for r in records),
        "charged_s": round(sum(charged), 4),  # request-level-charged: the load path's wait
        "visible_s": round(sum(visible), 4),
        "visible_ms_p50": round(1000 * statistics.median(visible), 3) if visible else None,
        "visible_ms_max": round(1000 * max(visible), 3) if visible else None,
        "visible_share": round(sum(visible) / (num_instances * wall_s), 5),
        "copy_gb_s": round(sum(b for b, s in loads if b > 0) / load_s / 1e9, 3)
        if load_s > 0 else None,
    }  # fmt: skip


def memory_numbers(files: Mapping[str, Any], device_kv_bytes: int) -> dict[str, Any]:
    """KV and Model Cache use: the host KV cache's and each instance's device KV peak over
    the run's samples, and the Model Cache at the end."""
    samples = files.get("kv") or []
    host_peak = max((int(s.get("used_bytes") or 0) for s in samples), default=None)
    host_capacity = next((s.get("capacity_bytes") for s in samples if s.get("capacity_bytes")),
                         None)  # fmt: skip
    device_peak: dict[str, int] = {}
    for sample in samples:
        for inst, dev in (sample.get("devices") or {}).items():
            used = int(dev.get("kv_used_bytes") or 0)
            device_peak[inst] = max(device_peak.get(inst, 0), used)
    cache = (((files.get("stats") or {}).get("cache") or {}).get("model_cache")) or {}
    budget = cache.get("budget_bytes")
    peak_share = (max(device_peak.values()) / device_kv_bytes
                  if device_peak and device_kv_bytes else None)  # fmt: skip
    return {
        "host_kv_peak_bytes": host_peak, "host_kv_capacity_bytes": host_capacity,
        "device_kv_peak_bytes": device_peak, "device_kv_capacity_bytes": device_kv_bytes,
        "device_kv_peak_share": round(peak_share, 4) if peak_share is not None else None,
        "model_cache": {
            "used_bytes": cache.get("used_bytes"), "budget_bytes": budget,
            "models": len(cache.get("models") or []), "loads": cache.get("num_loads"),
            "hits": cache.get("num_hits"), "evictions": cache.get("num_evictions"),
        },
    }  # fmt: skip


RESULT_KEYS = ("slo_attainment", "requests", "completed", "failed", "refused", "unfinished",
               "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "switches",
               "prefetched_switches")  # fmt: skip


def run_point(bench: Mapping[str, Any] | None, files: Mapping[str, Any],
              model_bytes: Mapping[str, int], num_instances: int,
              device_kv_bytes: int) -> dict[str, Any]:
    """One (policy, rate) run: ``bench serve``'s result, its switches, memory and the
    engine's costs. ``slo_attainment`` is null (with ``why``) for a run without
    requests or without a result: it says nothing about the rate."""
    bench = bench or {}
    point: dict[str, Any] = {k: bench.get(k) for k in RESULT_KEYS}
    if not bench:
        point["why"] = "bench serve gave no result"
    elif not bench.get("requests"):
        point["slo_attainment"], point["why"] = None, "no requests arrived"
    summary = files.get("summary") or {}
    if "start_s" in summary:
        point["wall_s"] = round(float(summary["end_s"]) - float(summary["start_s"]), 2)
    point["switch"] = switch_numbers(files, model_bytes, num_instances)
    point["memory"] = memory_numbers(files, device_kv_bytes)
    point["engine"] = engine_costs(files)
    return point
