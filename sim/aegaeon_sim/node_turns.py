"""Decode costs of a live node, measured from its turn records (see node_costs.py).

A live decode turn (services/decode ``TurnRunner.run``) is recorded with its
wall span, ``switch_s`` (swap-in orders, the switch-in and the next model's
prefetch order: everything before the first step), ``kv_wait_s``, steps and
tokens; each instance's ``decode_s`` counter sums the engine time of its
steps (forward pass and sampling). The rest of a turn, ``wall - switch_s -
kv_wait_s - engine``, is the loop's own time (polling the inbox, KV
bookkeeping, streaming tokens out, the turn record).

Eq. 6 of the instance's start-up profile gives a warm step (the profile
repeats steps of one model on an idle node); per turn, ``warm = steps x
Eq. 6(model, batch = tokens / steps, context = batch x the model's mean
context in the trace)``. Live turns take longer than that, by a part per
turn and a part per step: on this node one-step turns after a switch take
3-5 ms more than the warm step, and each further step about 1 ms more (the
switched-in weights are cold in the caches, the next model's prefetch copy
ordered at the turn's start competes for memory bandwidth and the two cores,
and the loop has its own work per step). ``wall - warm = per_step x steps +
per_turn`` is fitted over the turns that began with a switch (least squares,
twice trimmed of residuals beyond 3 MADs; over every turn when fewer than 5%
of the steps follow a switch, which then has no per-turn part).

The engine counters split the excess: the per-turn part is engine time on
the first step after a switch (``cold_step_s``), and Eq. 6 is scaled
(``decode_scale``) so that warm x scale + cold per switch make the live
engine seconds; what the per-step excess has beyond that scaling is the
loop's own time per step (``step_overhead_s``). If the per-turn part alone
exceeds the engine excess, the cold step gets the excess (scale 1) and the
rest of the per-turn part is loop time. ``turn_overhead_s``: that loop time
plus the median ``switch_s`` of turns that did not switch (what a turn
spends before its first step besides switching). Unified instances prefill inside
their turns, and only totals are known there: Eq. 6 is scaled to the
engine seconds, and the loop time per step is the rest, less every prefill.

Turn records that carry their engine seconds (``engine_s``) also give each
model its own factor on top (``model_scale``, its engine over Eq. 6 relative
to the node's): the start-up profile fits some models on their own and the
rest on shared coefficients, which here were up to 30% apart for models of
one shape, and small models spend more per step than Eq. 6's width term says.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aegaeon_sched import LatencyModel
from aegaeon_workload.stats_json import instance_counter

MIN_TURNS = 20
COLD_SHARE = 0.05
MIN_MODEL_WARM_S = 0.5  # a model's recorded Eq. 6 seconds before it gets its own scale


@dataclass(frozen=True)
class DecodeCosts:
    step_overhead_s: float
    turn_overhead_s: float
    cold_step_s: float
    decode_scale: float
    switch_turns: int  # live turns that began with a switch and decoded
    turn_steps: int
    # Per model, its engine seconds over its Eq. 6 share, relative to the node's.
    model_scale: Mapping[str, float] = field(default_factory=dict)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of y ~ x by least squares, twice trimmed at 3 MADs."""
    pts = list(points)
    slope, icept = 0.0, 0.0
    for _ in range(3):
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 0.0
        icept = my - slope * mx
        res = [y - slope * x - icept for x, y in pts]
        mad = statistics.median(abs(r) for r in res) or 1e-9
        kept = [p for p, r in zip(pts, res, strict=True) if abs(r) <= 3 * mad * 1.4826]
        if len(kept) < MIN_TURNS or len(kept) == len(pts):
            break
        pts = kept
    return slope, icept


def decode_costs(
    stats: Mapping[str, Any],
    trace: Sequence[Mapping[str, Any]],
    profiles: Mapping[str, LatencyModel],
    defaults: DecodeCosts,
) -> DecodeCosts:
    """See the module docstring; ``defaults`` where a run has too few turns."""
    turns = [t for t in stats.get("turns") or [] if str(t.get("instance")) in profiles]
    if sum(1 for t in turns if int(t["steps"]) > 0) < MIN_TURNS:
        return defaults
    ctx: dict[str, list[float]] = {}
    for r in trace:
        ctx.setdefault(str(r["model"]), []).append(
            float(r.get("prompt_tokens") or 0) + 0.5 * float(r["expected_tokens"])
        )
    switch_at: dict[str, list[float]] = {}
    for s in stats.get("switches") or []:
        switch_at.setdefault(str(s.get("instance")), []).append(float(s["at_s"]))
    rows: list[tuple[int, float, float, bool]] = []  # steps, warm engine, wall, switched
    per_model: dict[str, list[float]] = {}  # model -> [warm, engine] over its recorded turns
    plain: list[float] = []
    for t in turns:
        start, span, steps = float(t["start_s"]), float(t["switch_s"]), int(t["steps"])
        switched = any(start <= a <= start + span + 1e-3 for a in switch_at.get(t["instance"], []))
        if not switched:
            plain.append(span)
        if steps <= 0:
            continue
        batch = max(1.0, int(t["tokens"]) / steps)
        context = batch * statistics.fmean(ctx.get(t["model"], [1000.0]))
        warm = steps * profiles[t["instance"]].decode_step_s(t["model"], batch, context)
        wall = float(t["end_s"]) - start - span - float(t["kv_wait_s"])
        rows.append((steps, warm, wall, switched))
        if "engine_s" in t:
            acc = per_model.setdefault(str(t["model"]), [0.0, 0.0])
            acc[0] += warm
            acc[1] += float(t["engine_s"])
    steps_total = sum(r[0] for r in rows)
    counted = instance_counter(stats, "steps")
    engine = instance_counter(stats, "decode_s") * min(
        1.0, steps_total / max(counted, 1.0)
    )  # records may be truncated, counters are not
    warm_total = sum(r[1] for r in rows)
    switch_turns = sum(1 for r in rows if r[3])
    pre = statistics.median(plain) if len(plain) >= MIN_TURNS else defaults.turn_overhead_s
    if (stats.get("layout") or {}).get("unified"):
        prefill = sum(float(t.get("prefill_s", 0.0)) for t in stats.get("timings") or [])
        rest = sum(r[2] for r in rows) - engine - prefill
        scale = engine / warm_total if warm_total > 0 else 1.0
        return DecodeCosts(max(0.0, rest / steps_total), pre, 0.0, scale, switch_turns,
                           steps_total, _model_scale(per_model))  # fmt: skip
    cold_regime = switch_turns >= COLD_SHARE * steps_total
    fit = [(float(n), wall - warm) for n, warm, wall, sw in rows if sw or not cold_regime]
    per_step, per_turn = _line(fit) if len(fit) >= MIN_TURNS else (0.0, 0.0)
    cold = max(0.0, per_turn) if cold_regime else 0.0
    excess = engine - warm_total
    if cold * switch_turns > excess:
        cold = max(0.0, excess) / switch_turns if switch_turns else 0.0
    scale = (engine - cold * switch_turns) / warm_total if warm_total > 0 else 1.0
    mean_warm = warm_total / steps_total
    loop_per_turn = max(0.0, per_turn) - cold if cold_regime else 0.0
    return DecodeCosts(
        step_overhead_s=max(0.0, per_step - (scale - 1.0) * mean_warm),
        turn_overhead_s=pre + max(0.0, loop_per_turn), cold_step_s=cold,
        decode_scale=scale, switch_turns=switch_turns, turn_steps=steps_total,
        model_scale=_model_scale(per_model),
    )  # fmt: skip


def _model_scale(per_model: Mapping[str, list[float]]) -> dict[str, float]:
    """Each model's engine/Eq. 6 ratio over the node's (1 on average): the start-up
    profile fits some models on their own and the rest on shared coefficients,
    which can be several percent apart for models of one shape."""
    warm = sum(w for w, _ in per_model.values())
    engine = sum(e for _, e in per_model.values())
    if warm <= 0 or engine <= 0:
        return {}
    node = engine / warm
    return {m: (e / w) / node for m, (w, e) in per_model.items() if w >= MIN_MODEL_WARM_S}
