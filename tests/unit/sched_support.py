"""Helpers shared by the scheduling tests: a latency model of round numbers, and the
request-level baselines' requests and actions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aegaeon_sched import Action, LatencyModel, ModelSpec, Request, RunOnInstance


def run_actions(actions: list[Action]) -> list[tuple[str, str, str]]:
    """(instance, request id, model) of RunOnInstance actions; nothing else allowed."""
    out = []
    for act in actions:
        assert isinstance(act, RunOnInstance)
        out.append((act.instance, act.request.request_id, act.model))
    return out


def req(i: int, model: str, at: float, out: int = 100) -> Request:
    """Request ``r{i}`` of 50 prompt tokens and ``out`` output tokens (known to the oracle)."""
    return Request(f"r{i}", model, at, 50, out, oracle_output_len=out)


def tiny_latency(models: Iterable[str] | Mapping[str, float], *, prefill_s: float = 1e-3,
                 prefill_const_s: float = 0.0, decode_s: float = 0.0,
                 decode_per_seq_s: float | None = None, switch_s: float = 1.0,
                 switch_beta: float = 1.0) -> LatencyModel:  # fmt: skip
    """Eq. 4-6 with round numbers over one-layer models on a 1 GB/s link: a prefill
    costs ``prefill_s`` a prompt token plus ``prefill_const_s``, a decode step
    ``decode_s`` (plus ``decode_per_seq_s`` a sequence), a switch ``switch_s`` (or, for
    ``models`` given as a mapping, each model's own seconds) at ``switch_beta``."""
    switch = models if isinstance(models, Mapping) else dict.fromkeys(models, switch_s)
    specs = [ModelSpec(m, 64, 128, 1, int(s * 1e9), 1) for m, s in switch.items()]
    lat = LatencyModel(specs, pcie_bytes_per_s=1e9, switch_beta=switch_beta,
                       decode_per_seq_term=decode_per_seq_s is not None)  # fmt: skip
    width = specs[0].layer_width
    lat.set_prefill_coefficients("*", [prefill_s / width, 0.0, prefill_const_s])
    per_seq = [] if decode_per_seq_s is None else [decode_per_seq_s / width]
    lat.set_decode_coefficients("*", [decode_s / width, 0.0, *per_seq])
    return lat
