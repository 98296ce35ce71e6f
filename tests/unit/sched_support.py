"""Helpers shared by the request-level baseline tests."""

from __future__ import annotations

from aegaeon_sched import Action, Request, RunOnInstance


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
