"""What ``scripts/gpu-check`` shows: each step's few headline numbers, and a console summary.

The operator of a device run sees only the end of the console, so the
summary fits in a few kilobytes: a line per step, the error tail of each
step that did not pass, and the highlights as one JSON line. Standard
library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

ERROR_LINES_CHARS = 1200

_SERVE_KEYS = ("slo_attainment", "requests", "completed", "failed", "switches",
               "prefetched_switches", "ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "qos")
_SWITCH_ROW_KEYS = ("nbytes", "scale_up_ms", "scale_up_gb_s", "memcpy_gb_s", "load_over_memcpy",
                    "first_scale_up_ms")  # fmt: skip


def _imports(r: dict[str, Any]) -> Any:
    return {"missing": sorted(k for k, v in r.items() if str(v).startswith("MISSING"))}


def _probe(r: dict[str, Any]) -> Any:
    cache = r.get("model_cache") or {}
    return {"gpu": (r.get("gpu") or {}).get("name"), "copies": r.get("copies"),
            "model_cache_pinned": cache.get("pinned"),
            "shm_pinned_gb_s": cache.get("shm_pinned_gb_s"),
            "shm_pageable_gb_s": cache.get("shm_pageable_gb_s"),
            "read_only_register": cache.get("host_register_read_only_supported")}  # fmt: skip


def _market(r: list[dict[str, Any]]) -> Any:
    return {"models": len(r)}


def _tests(r: dict[str, Any]) -> Any:
    return {k: r.get(k) for k in ("passed", "failed", "skipped")} | {
        "failing": [f["test"] for f in r.get("failures", [])]}


def _engine(r: dict[str, Any]) -> Any:
    return {k: r.get(k) for k in ("device", "device_name", "model", "dtype", "ours",
                                  "transformers", "decode_speedup_vs_transformers_b8",
                                  "greedy_match", "greedy_match_bench_dtype")}


def _engine_step(r: dict[str, Any]) -> Any:
    """The engine scenario: each model's mixed batch of 8 (ms eager and on graphs, over its
    roofline, over transformers), the FP8 wake, the bounds met."""
    models: dict[str, Any] = {}
    for name, m in (r.get("models") or {}).items():
        row = (m.get("decode") or {}).get("b8_mixed") or {}
        peer = (r.get("transformers") or {}).get(name) or {}
        models[name] = {"b8_mixed_eager_ms": row.get("eager_ms"),
                        "b8_mixed_graphs_ms": row.get("graphs_ms"),
                        "over_roofline": row.get("over_roofline"),
                        "over_transformers": (peer.get("ours_over_peer") or {}).get("b8"),
                        "greedy_equal": m.get("greedy_equal")}
    bounds = r.get("targets") or []
    return {"device_name": r.get("device_name"), "d2d_gb_s": r.get("d2d_gb_s"),
            "models": models, "kernels": r.get("kernels"),
            "fp8_wake_s": (r.get("fp8_wake") or {}).get("wake_to_first_token_s"),
            "bounds_met": sum(1 for b in bounds if b.get("met")),
            "bounds": len(bounds)}  # fmt: skip


def _switch(r: dict[str, Any]) -> Any:
    rows = r.get("models") or {}
    return {
        "device": r.get("device"), "memcpy": r.get("memcpy"),
        "load_over_memcpy": r.get("load_over_memcpy"),
        "model_cache_pinned": r.get("model_cache_pinned"),
        "per_model": {m: {k: row.get(k) for k in _SWITCH_ROW_KEYS} for m, row in rows.items()},
        "switch_ms": r.get("switch_ms"), "switch_ms_prefetch": r.get("switch_ms_prefetch"),
        "check": r.get("check"),
    }  # fmt: skip


def _fp8(r: dict[str, Any]) -> Any:
    return {k: r.get(k) for k in ("model", "wake_to_first_token_s", "target_s", "target_met",
                                  "switch_ms", "scale_up_ms", "scale_up_gb_s", "bytes_moved",
                                  "bf16_bytes", "bytes_over_bf16")}


def _serve(r: dict[str, Any]) -> Any:
    bench = r.get("bench") or {}
    return {
        "startup_s": r.get("startup_s"), "stop_s": r.get("stop_s"),
        **{k: bench.get(k) for k in _SERVE_KEYS},
        "service_errors": len(r.get("service_errors") or []),
        "leaked_processes": len(r.get("leaked_processes") or []),
        "leaked_shm": len(r.get("leaked_shm") or []),
        "gpu_processes_serving": r.get("gpu_processes_serving"),
        "engine_ms_per_step": r.get("engine_ms_per_step"),
    }  # fmt: skip


def _paper_models(r: dict[str, Any]) -> Any:
    choice = r.get("choice") or {}
    return {"models": [m.get("preset") for m in r.get("models") or []],
            "bytes": sum(int(m.get("bytes") or 0) for m in r.get("models") or []),
            "binding": choice.get("binding"), "generate_gb_s": r.get("generate_gb_s"),
            "copy_gb_s": r.get("copy_gb_s"), "load_gb_s": r.get("load_gb_s")}  # fmt: skip


def _paper_node(r: dict[str, Any]) -> Any:
    return {"startup_s": r.get("startup_s"), "stop_s": r.get("stop_s"),
            "service_errors": len(r.get("service_errors") or []),
            "leaked_processes": len(r.get("leaked_processes") or []),
            "leaked_shm": len(r.get("leaked_shm") or []),
            "model_cache_generation": r.get("model_cache_generation")}  # fmt: skip


def _namespaces(r: dict[str, Any]) -> Any:
    counts = r.get("counts") or {}
    return {"passed": r.get("passed"), "failed": r.get("failed"),
            **{k: counts.get(k) for k in ("device", "failed_frees", "blocks_freed_now",
                                          "blocks_freed_after_event")}}  # fmt: skip


def _leaks(r: dict[str, Any]) -> Any:
    return {"processes": len(r.get("processes") or []),
            "new_shm_segments": len(r.get("new_shm_segments") or [])}


_HIGHLIGHTS: dict[str, Callable[[Any], Any]] = {
    "imports": _imports, "probe": _probe, "market": _market, "gpu_tests": _tests,
    "tensor_parallel": _tests, "namespaces": _namespaces,
    "bench_engine": _engine, "bench_switch": _switch, "fp8_switch": _fp8, "serve": _serve,
    "engine_bench": _engine_step,
    "serve_mps": _serve,
    "leaks": _leaks, "paper_models": _paper_models,
}  # fmt: skip


def step_highlights(name: str, results: Any) -> Any:
    """The headline of one step's results (they may be partial: missing keys are None)."""
    fn = _HIGHLIGHTS.get(name)
    if fn is None and name.startswith("paper_") and isinstance(results, dict) and \
            "startup_s" in results:  # a node of the paper scenario (paper_<policy>[-n])
        fn = _paper_node
    if fn is None or not results:
        return None
    try:
        return fn(results)
    except (AttributeError, KeyError, TypeError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def print_summary(summary: dict[str, Any]) -> None:
    """The console's last screen (module docstring)."""
    m = summary.get("machine") or {}
    print(f"gpu-check {'(dry run) ' if summary.get('dry_run') else ''}on {m.get('gpu') or 'no GPU'}"
          f" (driver {m.get('driver')}, {m.get('pcie')}), torch {m.get('torch')} cuda "
          f"{m.get('cuda')}, {m.get('cpu_count')} x {m.get('cpu')}: "
          f"{'ok' if summary.get('ok') else 'NOT ok'} in {summary.get('total_s')} s")
    for step in summary.get("steps", []):
        why = f"  ({step['error']})" if step["status"] == "skipped" and step.get("error") else ""
        print(f"  {step['name']:13} {step['status']:8} {step['duration_s']:7.1f} s{why}")
    for step in summary.get("steps", []):
        if step["status"] not in ("ok", "skipped") and step.get("error"):
            print(f"--- {step['name']} ({step['status']}):")
            print(str(step["error"])[-ERROR_LINES_CHARS:])
    print("highlights: " + json.dumps(_rounded(summary.get("highlights")), default=str))
    if summary.get("paper"):
        print_paper(summary["paper"])


def print_paper(paper: dict[str, Any]) -> None:
    """The paper scenario's table: per policy and rate the requests, the measured and the
    predicted attainment; the sustainable rates and aegaeon's ratio to each; what a switch
    cost each policy, measured (``paper_report``'s rows)."""
    from aegaeon_bench.gpu_check.paper_report import headline, pct, policy_lines, rows

    print(headline(paper))
    print(f"  {'policy':22} {'RPS/model':>10} {'requests':>8} {'measured':>9} "
          f"{'simulated:':>10}")
    for row in rows(paper):
        print(f"  {row['policy']:22} {row['rps_per_model']:10.4g} {row['requests'] or '-':>8} "
              f"{pct(row['measured']):>9} {pct(row['predicted']):>10}")
    for line in policy_lines(paper):
        print("  " + line)


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits, all the way down (the console is short)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
