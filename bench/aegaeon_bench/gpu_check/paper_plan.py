"""The paper scenario's plan: which rates each policy runs, in what order, within the time.

Pure (plain values in and out, no clock, no I/O); standard library only, like
the rest of gpu-check.

1. **Rates from the prediction** (:func:`choose_rates`): one geometric grid of
   rates per model (:func:`rate_grid`, around the probe's unit rate) is shared by
   every policy, so that where two policies run the same rate they run the same
   requests (the same seed). The simulator predicts each policy's attainment on
   the grid; a policy runs the two grid rates around its predicted 90% crossing
   (the last that holds, the first that misses), three with ``points=3`` (one
   more below). A policy predicted to hold everywhere runs the grid's top rates,
   one predicted to miss everywhere its bottom ones; one whose predicted
   attainment never reaches 90% anywhere (static multiplexing with models left
   unplaced) runs the bottom rate alone.
2. **Interleaved, rate by rate** (:func:`order_runs`): every run at one rate
   before any at the next higher one; within a rate the policy whose node is up
   goes first and the one that also runs the next rate last, so a node is
   started again only when the policy changes.
3. **Within the time** (:func:`fit_budget`): when the runs and node starts do not
   fit, third points go first, then whole policies from the end of the priority
   order (the first policy always keeps a run); what was left out says why.
4. **Bracketed by measurement** (:func:`extend`): after a policy's planned runs,
   one more grid rate while its measured crossing is not bracketed (up while
   every run held, down while none did), up to ``max_points``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

TARGET = 0.9
GRID_LOW = 0.125  # x the unit rate
GRID_HIGH = 8.0
GRID_STEP = math.sqrt(2.0)


def rate_grid(unit: float, low: float = GRID_LOW, high: float = GRID_HIGH,
              step: float = GRID_STEP) -> list[float]:  # fmt: skip
    """``unit`` x ``low`` .. ``high`` in factors of ``step`` (ascending)."""
    if not (unit > 0 and 0 < low <= high and step > 1):
        raise ValueError(f"bad grid: unit {unit}, {low}..{high} by {step}")
    count = round(math.log(high / low) / math.log(step))
    return [unit * low * step**i for i in range(count + 1)]


@dataclass(frozen=True)
class PolicyRates:
    """The rates one policy runs, and why those."""

    policy: str
    rates: tuple[float, ...]  # ascending, from the grid
    why: str
    extend: bool = True  # may :func:`extend` add a rate after its runs


def choose_rates(policy: str, curve: Sequence[tuple[float, float]], points: int = 2,
                 target: float = TARGET) -> PolicyRates:  # fmt: skip
    """``policy``'s rates from its predicted ``curve`` (grid rate, attainment), see the
    module docstring."""
    if not curve:
        raise ValueError(f"{policy}: no predicted point")
    ordered = sorted(curve)
    rates = [r for r, _ in ordered]
    best = max(a for _, a in ordered)
    if best < target:
        return PolicyRates(policy, (rates[0],), f"predicted never to reach {target:.0%} on the "
                           f"grid (at best {best:.1%}): the lowest rate alone", extend=False)
    first_miss = next((i for i, (_, a) in enumerate(ordered) if a < target), None)
    if first_miss is None:
        chosen = rates[-points:]
        why = f"predicted to hold {target:.0%} at every grid rate: the top ones"
    elif first_miss == 0:
        chosen = rates[:points]
        why = f"predicted under {target:.0%} already at the lowest grid rate: the lowest ones"
    else:
        held, missed = first_miss - 1, first_miss
        picked = [held, missed] if points >= 2 else [held]
        if points >= 3:
            picked.append(held - 1 if held > 0 else missed + 1)
        chosen = [rates[i] for i in picked if 0 <= i < len(rates)]
        why = (f"predicted crossing between {rates[held]:.4g} and {rates[missed]:.4g}")
    return PolicyRates(policy, tuple(sorted(chosen)), why)


def extend(tried: Mapping[float, float | None], grid: Sequence[float], max_points: int,
           target: float = TARGET) -> float | None:  # fmt: skip
    """One more grid rate for a policy whose measured runs (``tried``: rate ->
    attainment) do not bracket its crossing, else None (bracketed, ``max_points``
    reached, the grid's end, or a run that measured nothing)."""
    if not tried or len(tried) >= max_points or any(a is None for a in tried.values()):
        return None
    held = [r for r, a in tried.items() if a is not None and a >= target]
    missed = [r for r, a in tried.items() if a is not None and a < target]
    if held and missed and max(held) < min(missed):
        return None
    ordered = sorted(grid)
    if not missed:
        above = [r for r in ordered if r > max(held)]
        return above[0] if above else None
    if not held:
        below = [r for r in ordered if r < min(missed)]
        return below[-1] if below else None
    # held above a miss (noise): the rate between them, if the grid has one
    between = [r for r in ordered if min(missed) < r < max(held) and r not in tried]
    return between[0] if between else None


def order_runs(rates: Mapping[str, Sequence[float]], priority: Sequence[str],
               first: str | None = None) -> list[tuple[str, float]]:  # fmt: skip
    """Every (policy, rate), rate by rate ascending (module docstring, 2); ``first``:
    the policy whose node is up at the start."""
    rank = {p: i for i, p in enumerate(priority)}
    by_rate: dict[float, list[str]] = {}
    for policy, chosen in rates.items():
        for rate in chosen:
            by_rate.setdefault(rate, []).append(policy)
    ordered_rates = sorted(by_rate)
    out: list[tuple[str, float]] = []
    current = first
    for i, rate in enumerate(ordered_rates):
        here = sorted(by_rate[rate], key=lambda p: rank.get(p, len(rank)))
        following = set(by_rate[ordered_rates[i + 1]]) if i + 1 < len(ordered_rates) else set()
        head = [current] if current in here else []
        rest = [p for p in here if p not in head]
        # one that also runs the next rate goes last, so its node carries on
        rest.sort(key=lambda p: (p in following, rank.get(p, len(rank))))
        for policy in head + rest:
            out.append((policy, rate))
            current = policy
    return out


def node_starts(order: Sequence[tuple[str, float]], first: str | None = None) -> int:
    """Nodes started to run ``order`` (one each time the policy changes)."""
    starts, current = 0, first
    for policy, _ in order:
        if policy != current:
            starts += 1
            current = policy
    return starts


@dataclass(frozen=True)
class Fitted:
    """What :func:`fit_budget` kept: each policy's rates, the order, its estimate."""

    rates: dict[str, tuple[float, ...]]
    order: list[tuple[str, float]]
    estimate_s: float
    left_out: dict[str, str] = field(default_factory=dict)  # policy -> why


RunSeconds = Callable[[str, float], float]  # (policy, rate) -> a run's seconds


def estimate_s(order: Sequence[tuple[str, float]], run_s: RunSeconds,
               start_s: float, first: str | None = None) -> float:
    """Seconds ``order`` takes: its runs and its node starts (a stop each, with them)."""
    return sum(run_s(p, rate) for p, rate in order) + node_starts(order, first) * start_s


def fit_budget(chosen: Sequence[PolicyRates], run_s: RunSeconds, start_s: float,
               budget_s: float, first: str | None = None) -> Fitted:  # fmt: skip
    """The plan within ``budget_s`` (module docstring, 3); ``chosen`` in priority order."""
    priority = [c.policy for c in chosen]
    rates = {c.policy: tuple(c.rates) for c in chosen}
    left_out: dict[str, str] = {}

    def attempt() -> tuple[list[tuple[str, float]], float]:
        order = order_runs(rates, priority, first)
        return order, estimate_s(order, run_s, start_s, first)

    order, total = attempt()
    for policy in reversed(priority):  # third points first, the last policy's first
        if total <= budget_s:
            break
        if len(rates[policy]) > 2:
            rates[policy] = rates[policy][1:]  # the extra one is the lowest
            order, total = attempt()
    for policy in reversed(priority[1:]):  # then whole policies
        if total <= budget_s:
            break
        del rates[policy]
        left_out[policy] = (f"no time: the plan needed {total:.0f} s of {budget_s:.0f} s with "
                            "it (run it alone with --paper-policies)")
        order, total = attempt()
    head = priority[0]
    while total > budget_s and len(rates[head]) > 1:
        rates[head] = rates[head][1:]
        order, total = attempt()
    return Fitted(rates, order, total, left_out)
