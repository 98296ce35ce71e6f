"""A node's plan written into its deployment config (plain data, as YAML reads it).

The plan (:mod:`aegaeon_sched.placement`, sized by :mod:`aegaeon_sched.sizing`)
replaces the devices, counts and sizes the config gives; every other key stays.
"""

from __future__ import annotations

from typing import Any

from aegaeon_sched.placement import Plan

__all__ = ["apply_plan"]

_SIZE_KEYS = {
    "prefill": ("device", "devices", "device_memory", "device_memory_bytes", "kv_memory",
                "kv_memory_bytes", "instances", "tp"),
    "cachemgr": ("model_cache", "model_cache_bytes", "kv_cache", "kv_cache_bytes"),
}  # fmt: skip


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    section = raw.get(key) or {}
    return {k: v for k, v in section.items() if k not in _SIZE_KEYS.get(key, _SIZE_KEYS["prefill"])}


def apply_plan(raw: dict[str, Any], plan: Plan, unified: bool = False) -> dict[str, Any]:
    """``raw`` (a deployment as plain data) with the plan's devices, counts and sizes
    in place of the config's; sections the plan did not size are left as they are.

    ``unified`` (the request-level policies): every worker is a decode instance,
    prefill's first, so the decode section takes every planned device and the
    smaller of the two kinds' sizes.
    """
    out = dict(raw)
    kinds = [k for k in (plan.kind("prefill"), plan.kind("decode")) if k is not None]
    for k in kinds:
        out[k.kind] = {
            **_section(raw, k.kind),
            "instances": k.instances,
            "device": k.devices[0],
            "devices": list(k.devices),
            "device_memory": k.device_memory_bytes,
            "kv_memory": k.kv_memory_bytes,
            **({"tp": k.tp} if k.tp > 1 else {}),
        }
    if unified and len(kinds) == 2:
        decode = dict(out["decode"])
        decode["devices"] = [*kinds[0].devices, *kinds[1].devices]
        decode["device_memory"] = min(k.device_memory_bytes for k in kinds)
        decode["kv_memory"] = min(k.kv_memory_bytes for k in kinds)
        out["decode"] = decode
    if plan.cache is not None:
        out["cachemgr"] = {**_section(raw, "cachemgr"),
                           "model_cache": plan.cache.model_cache_bytes,
                           "kv_cache": plan.cache.kv_cache_bytes}  # fmt: skip
    return out
