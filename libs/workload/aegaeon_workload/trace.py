"""The files of a `bench serve` run: the trace and the services' view beside it.

``TRACE`` (``--trace FILE``), JSON lines, one per request::

    {"request_id", "model", "arrival_s", "token_times_s": [...],
     "expected_tokens", "status": "ok" | "failed",
     "sent_s", "prompt_tokens", "num_events", "error", "server_id"}

All times are ``time.time()`` seconds on the client's clock (the services
stamp their records on the same host clock). ``token_times_s[k]`` is when
token ``k`` reached the client (see :func:`aegaeon_bench.report.metrics.token_times`);
the last five keys are extras: when the request was actually sent (the
arrival is the planned one), its prompt length, how many SSE events carried
its text, why it failed, and the id the services know it by (the
``request_id`` of their timings).

Beside it:

- ``TRACE.stats.json``: the final ``GET /v1/aegaeon/stats`` (verbatim).
- ``TRACE.kv.jsonl``: the unified CPU KV cache sampled about every second,
  one :func:`kv_sample` object per line.
- ``TRACE.summary.json``: the run's settings (SLO targets, rates, scales) and
  its metrics, the object ``--json`` prints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aegaeon_sched.slo import RequestTrace

from aegaeon_workload.stats_json import heartbeats

Status = Literal["ok", "failed"]


@dataclass(frozen=True)
class TraceRecord:
    """One request as the client saw it."""

    request_id: str
    model: str
    arrival_s: float
    token_times_s: tuple[float, ...]
    expected_tokens: int
    status: Status
    sent_s: float | None = None
    prompt_tokens: int | None = None
    num_events: int | None = None
    error: str | None = None
    server_id: str | None = None

    def to_slo(self) -> RequestTrace:
        """The request as :mod:`aegaeon_sched.slo` scores it."""
        return RequestTrace(
            request_id=self.request_id,
            arrival_s=self.arrival_s,
            expected_tokens=self.expected_tokens,
            token_times_s=self.token_times_s,
            failed=self.status != "ok",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "model": self.model, "arrival_s": self.arrival_s,
            "token_times_s": list(self.token_times_s), "expected_tokens": self.expected_tokens,
            "status": self.status, "sent_s": self.sent_s, "prompt_tokens": self.prompt_tokens,
            "num_events": self.num_events, "error": self.error, "server_id": self.server_id,
        }  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TraceRecord:
        status = obj["status"]
        if status not in ("ok", "failed"):
            raise ValueError(f"status must be 'ok' or 'failed', got {status!r}")
        return cls(
            request_id=str(obj["request_id"]),
            model=str(obj["model"]),
            arrival_s=float(obj["arrival_s"]),
            token_times_s=tuple(float(t) for t in obj["token_times_s"]),
            expected_tokens=int(obj["expected_tokens"]),
            status=status,
            sent_s=_opt_float(obj.get("sent_s")),
            prompt_tokens=_opt_int(obj.get("prompt_tokens")),
            num_events=_opt_int(obj.get("num_events")),
            error=_opt_str(obj.get("error")),
            server_id=_opt_str(obj.get("server_id")),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True)
class RunFiles:
    """The paths of one run's files, derived from the trace's."""

    trace: Path
    stats: Path = field(init=False)
    kv: Path = field(init=False)
    summary: Path = field(init=False)

    def __post_init__(self) -> None:
        for kind, suffix in (("stats", ".stats.json"), ("kv", ".kv.jsonl"),
                             ("summary", ".summary.json")):  # fmt: skip
            object.__setattr__(self, kind, self.trace.with_name(self.trace.name + suffix))


def write_trace(path: Path, records: Iterable[TraceRecord]) -> None:
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record.to_json()) + "\n")


def read_trace(path: Path) -> list[TraceRecord]:
    """The records of a trace file; a bad line is a ``ValueError`` naming it."""
    records: list[TraceRecord] = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(TraceRecord.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: bad trace line ({exc})") from None
    return records


def plain_json(value: Any) -> Any:
    """``value`` with NaN and infinities as ``null`` (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_json(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(plain_json(obj), indent=1) + "\n")


def write_jsonl(path: Path, objs: Sequence[Any]) -> None:
    path.write_text("".join(json.dumps(plain_json(o)) + "\n" for o in objs))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shape_label(shape: Mapping[str, Any]) -> str:
    """A KV shape as a short label: ``L6 H8 D128 bfloat16``."""
    return (f"L{shape.get('num_layers')} H{shape.get('num_kv_heads')} "
            f"D{shape.get('head_dim')} {shape.get('dtype')}")  # fmt: skip


def kv_sample(stats: Mapping[str, Any], t_s: float) -> dict[str, Any]:
    """One line of ``TRACE.kv.jsonl`` from a ``/v1/aegaeon/stats`` answer.

    ``{"t_s", "fragmentation", "used_bytes", "held_bytes", "peak_used_bytes",
    "slab_bytes", "capacity_bytes", "shapes": {label: {"block_bytes", "used_blocks", "held_slabs",
    "fragmentation"}}, "devices": {instance: {"kv_used_bytes",
    "kv_fragmentation"}}}``; cache fields are ``null`` when cachemgr did not
    answer. Fragmentation is the cache's own: unused over peak allocated.
    """
    kv = (stats.get("cache") or {}).get("kv") or {}
    shapes = {
        shape_label(s.get("shape") or {}): {
            key: s.get(key) for key in ("block_bytes", "used_blocks", "held_slabs", "fragmentation")
        }
        for s in kv.get("shapes") or []
    }
    devices = {
        name: {key: (inst.get("counters") or {}).get(key)
               for key in ("kv_used_bytes", "kv_fragmentation")}
        for name, inst in heartbeats(stats).items()
        if inst and "kv_used_bytes" in (inst.get("counters") or {})
    }  # fmt: skip
    return {
        "t_s": t_s,
        **{key: kv.get(key) for key in ("fragmentation", "used_bytes", "held_bytes",
                                        "peak_used_bytes", "slab_bytes", "capacity_bytes")},
        "shapes": shapes,
        "devices": devices,
    }  # fmt: skip
