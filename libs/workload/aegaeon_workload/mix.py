"""Past the paper's workload: SLO-class mixes and ON/OFF bursts (issue 19).

Shared by the simulator (``aegaeon sim --classes`` / ``--roles``) and the live
``aegaeon bench serve --priority-mix`` / ``--burst``, so both run the same trace
for one seed.

- **Class mix** (:func:`parse_mix`, :func:`assign_classes`): each request
  draws its SLO class (``interactive`` / ``standard`` / ``batch``, the request
  field ``priority``) from the mix on its own seeded stream, so a request's
  class depends only on the seed and its id, never on what else is in the trace.
- **ON/OFF bursts** (:class:`Burst`, :func:`generate_bursty`): arrivals are
  Poisson at the base rate while OFF and ``factor`` times it while ON. The
  shape follows TokenScale: bursts of seconds (their Azure trace's average
  2.3 s, bursty 47% of the time) and a 10x step (§VI-B2, 1 -> 10 RPS). The
  trace is drawn at the peak rate with :func:`~aegaeon_workload.synthetic.generate`
  (the same lengths) and thinned to the OFF rate outside the bursts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from aegaeon_sched import CLASS_NAMES, Request

from aegaeon_workload.synthetic import WorkloadSpec, generate

Mix = tuple[tuple[str, float], ...]


def parse_mix(text: str) -> Mix:
    """``"interactive=0.3,batch=0.7"`` -> ``(("interactive", 0.3), ("batch", 0.7))``.

    Shares must be > 0 and are normalised to sum to 1; names are the SLO classes.
    """
    out: list[tuple[str, float]] = []
    for part in text.split(","):
        name, sep, share = part.strip().partition("=")
        if not sep or name not in CLASS_NAMES:
            raise ValueError(f"class mix {text!r}: want NAME=SHARE with NAME in {CLASS_NAMES}")
        value = float(share)
        if value <= 0:
            raise ValueError(f"class mix {text!r}: shares must be > 0")
        out.append((name, value))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"class mix {text!r}: a class is named twice")
    total = sum(v for _, v in out)
    return tuple((n, v / total) for n, v in out)


def format_mix(mix: Mix) -> str:
    return ",".join(f"{n}={v:g}" for n, v in mix)


def class_of(request_id: str, mix: Mix, seed: int) -> str:
    """The class request ``request_id`` draws from ``mix`` (seeded per request)."""
    u = random.Random(f"class/{seed}/{request_id}").random()
    acc = 0.0
    for name, share in mix:
        acc += share
        if u < acc:
            return name
    return mix[-1][0]


def assign_classes(requests: Sequence[Request], mix: Mix, seed: int) -> dict[str, str]:
    """Request id -> class name."""
    return {r.request_id: class_of(r.request_id, mix, seed) for r in requests}


@dataclass(frozen=True)
class Burst:
    """ON/OFF arrivals: ``factor`` x the base rate for ``on_s`` every ``period_s``
    (the first burst starts at ``first_s``)."""

    on_s: float = 5.0
    period_s: float = 30.0
    factor: float = 10.0
    first_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.on_s < self.period_s or self.factor < 1 or self.first_s < 0:
            raise ValueError("need 0 < on_s < period_s, factor >= 1, first_s >= 0")

    def is_on(self, t: float) -> bool:
        if t < self.first_s:
            return False
        return (t - self.first_s) % self.period_s < self.on_s

    def starts(self, duration_s: float) -> list[float]:
        """When each burst starts within ``[0, duration_s)``."""
        out, t = [], self.first_s
        while t < duration_s:
            out.append(t)
            t += self.period_s
        return out

    def mean_factor(self) -> float:
        """The mean rate over a period, in units of the base rate."""
        return (self.on_s * self.factor + self.period_s - self.on_s) / self.period_s


def parse_burst(text: str) -> Burst:
    """``"on=5,period=30,factor=10,first=10"`` (any subset; the rest default)."""
    keys = {"on": "on_s", "period": "period_s", "factor": "factor", "first": "first_s"}
    kwargs: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"burst {text!r}: want KEY=VALUE with KEY in {tuple(keys)}")
        kwargs[keys[key]] = float(value)
    return Burst(**kwargs)


def generate_bursty(spec: WorkloadSpec, burst: Burst) -> list[Request]:
    """``spec.rps_per_model`` is the OFF (base) rate; see the module docstring.

    Drawn at the peak rate and thinned outside the bursts (each request kept
    with probability ``1 / factor``, on its own seeded stream): the ON periods
    hold exactly the peak-rate trace's requests.
    """
    peak = generate(replace(spec, rps_per_model=spec.rps_per_model * burst.factor))
    keep = 1.0 / burst.factor
    out = []
    for r in peak:
        if burst.is_on(r.arrival_s) or (
            random.Random(f"thin/{spec.seed}/{r.request_id}").random() < keep
        ):
            out.append(r)
    return out
