"""The JSON of `aegaeon bench sweep`, read by `aegaeon bench report --sweep`.

A sweep runs `bench serve` once per (policy, number of models[, rps]) and
collects one point per run::

    {"version": 1,
     "points": [{"policy": "aegaeon", "models": 4, "slo_attainment": 0.93,
                 "rps_per_model": 0.2, "qos": ..., "ttft_p50": ..., "ttft_p99": ...,
                 "tbt_p50": ..., "tbt_p99": ..., "switches": ..., "completed": ...,
                 "failed": ..., "requests": ..., "trace": "path or null"}, ...],
     "meta": {"ttft_s": ..., "tbt_s": ..., ...anything else: scales, duration, market}}

``policy``, ``models`` and ``slo_attainment`` are required; every other
point key is optional (``null`` when unknown) and unknown keys are kept in
``extra``. Attainment and qos are fractions in [0, 1]; times are seconds.
``meta`` is free-form; the report shows ``ttft_s`` and ``tbt_s`` (the SLO
targets every point was scored with) when present.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from aegaeon_workload.trace import plain_json

SWEEP_VERSION = 1


class SweepError(ValueError):
    """A sweep file that does not follow the schema."""


@dataclass(frozen=True)
class SweepPoint:
    """One `bench serve` run of a sweep."""

    policy: str
    models: int
    slo_attainment: float
    rps_per_model: float | None = None
    qos: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tbt_p50: float | None = None
    tbt_p99: float | None = None
    switches: int | None = None
    completed: int | None = None
    failed: int | None = None
    requests: int | None = None
    trace: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_result(cls, policy: str, models: int, result: Mapping[str, Any], *,
                    rps_per_model: float | None = None, trace: str | None = None
                    ) -> SweepPoint:  # fmt: skip
        """A point from the object `bench serve --json` prints (extra keys go to ``extra``)."""
        return cls.from_json({**result, "policy": policy, "models": models,
                              "rps_per_model": rps_per_model, "trace": trace})

    def to_json(self) -> dict[str, Any]:
        obj = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **obj}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SweepPoint:
        try:
            policy, models, attainment = obj["policy"], obj["models"], obj["slo_attainment"]
        except KeyError as exc:
            raise SweepError(f"a sweep point needs {exc.args[0]!r}: {dict(obj)}") from None
        if not isinstance(policy, str) or isinstance(models, bool) or not isinstance(models, int):
            raise SweepError(f"bad policy/models in sweep point {dict(obj)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: obj.get(k) for k in known - {"policy", "models", "slo_attainment"}}
        extra = {k: v for k, v in obj.items() if k not in known}
        return cls(policy=policy, models=models, slo_attainment=float(attainment), extra=extra,
                   **values)  # fmt: skip


@dataclass(frozen=True)
class Sweep:
    points: tuple[SweepPoint, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"version": SWEEP_VERSION, "points": [p.to_json() for p in self.points],
                "meta": dict(self.meta)}  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> Sweep:
        if not isinstance(obj, dict) or not isinstance(obj.get("points"), list):
            raise SweepError("a sweep is an object with a 'points' list")
        version = obj.get("version", SWEEP_VERSION)
        if version != SWEEP_VERSION:
            raise SweepError(f"sweep version {version!r}, this reader knows {SWEEP_VERSION}")
        return cls(tuple(SweepPoint.from_json(p) for p in obj["points"]), obj.get("meta") or {})

    def series(self) -> dict[str, list[SweepPoint]]:
        """Points by policy (and rps when a sweep has several), each sorted by models."""
        rates = {p.rps_per_model for p in self.points if p.rps_per_model is not None}
        groups: dict[str, list[SweepPoint]] = {}
        for point in self.points:
            label = point.policy if len(rates) <= 1 else f"{point.policy} @ {point.rps_per_model}"
            groups.setdefault(label, []).append(point)
        return {k: sorted(v, key=lambda p: p.models) for k, v in sorted(groups.items())}


def load_sweep(path: Path) -> Sweep:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SweepError(f"{path}: cannot read ({exc})") from None
    return Sweep.from_json(obj)


def dump_sweep(path: Path, points: Sequence[SweepPoint], meta: Mapping[str, Any]) -> None:
    """Write a sweep file (NaN and infinities as ``null``)."""
    path.write_text(json.dumps(plain_json(Sweep(tuple(points), meta).to_json()), indent=1) + "\n")
