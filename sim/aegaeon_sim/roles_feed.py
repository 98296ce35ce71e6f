"""Role switching in the simulator: heartbeats that feed :class:`aegaeon_sched.RoleController`.

Every instance is prefill- and decode-capable (a hybrid: the decode loop with its
prefill side), the configured decode instances start in standby (the policy's
``PolicyOptions.standby``). Every heartbeat (0.5 s, the services' period)
:class:`RoleFeed` observes what the live proxy observes and hands it to the
controller; each change it returns is carried out with
:meth:`AegaeonPolicy.set_role <aegaeon_sched.AegaeonPolicy.set_role>`, whose
actions the simulation applies (an instance leaving the prefill role drains:
its queued groups still run there). It meters the signals as the proxy does
(:class:`aegaeon_sched.RoleMeter`): the busy seconds are the loop's ``prefill_s`` plus
``switch_s`` (its compute and its switches, ten times a prefill's compute at H800 scale).

Without a controller (fixed roles) the feed only samples, so both runs
report the same burst figures: :func:`absorb_times`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aegaeon_sched import (
    Action,
    AegaeonPolicy,
    LatencyModel,
    Request,
    RoleController,
    RoleMeter,
)
from aegaeon_sched.roles import estimated_prefill_velocity

if TYPE_CHECKING:
    from aegaeon_sim.instances import SimInstance

HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class Sample:
    t_s: float
    backlog_tokens: int
    prefill_role: int  # instances in the prefill role
    arrival_tokens_per_s: float


class RoleFeed(RoleMeter):
    """See the module docstring. ``apply``: the simulation's action handler."""

    def __init__(
        self,
        policy: AegaeonPolicy,
        prefills: Sequence[SimInstance],
        requests: Iterable[Request],
        latency: LatencyModel,
        models: Sequence[str],
        apply: Callable[[list[Action], float], None],
        controller: RoleController | None = None,
        *,
        interval_s: float = HEARTBEAT_S,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.prefills = list(prefills)
        self.controller = controller
        self.apply = apply
        self.interval_s = interval_s
        self._arrivals = sorted(((r.arrival_s, r.prompt_len) for r in requests), reverse=True)
        self._estimate = estimated_prefill_velocity(latency, models) if models else 0.0
        self.samples: list[Sample] = []

    def start(self, schedule: Callable[[float, Callable[[float], None]], None],
              end_s: float) -> None:  # fmt: skip
        def beat(now_s: float) -> None:
            self.observe(now_s)
            if now_s + self.interval_s <= end_s:
                schedule(now_s + self.interval_s, beat)

        schedule(0.0, beat)

    def prefill_velocity(self) -> dict[str, float]:
        measured = {p.name: self.measured(p.counters.prefill_tokens, p.counters.prefill_s,
                                          _busy_s(p)) for p in self.prefills}  # fmt: skip
        return {p: self._estimate if v is None else v for p, v in measured.items()}

    def observe(self, now_s: float) -> None:
        while self._arrivals and self._arrivals[-1][0] <= now_s:
            self.arrived(*self._arrivals.pop())
        load = self.policy.role_load()  # the queued prompt tokens, Eq. 3's decode demand
        assert load is not None
        arrival = self.arrivals.rate(now_s)
        for p in self.prefills:
            self.beat(p.name, now_s, _busy_s(p))
        if self.controller is not None:
            signals = self.signals(now_s, backlog_tokens=load.backlog_tokens,
                                   prefill_velocity=self.prefill_velocity(),
                                   decode_demand=load.decode_demand)  # fmt: skip
            for change in self.controller.observe(now_s, signals):
                self.apply(self.policy.set_role(change.instance, change.role, now_s), now_s)
        num_prefill = sum(self.policy.prefill_role(p.name) for p in self.prefills)
        self.samples.append(Sample(now_s, load.backlog_tokens, num_prefill, arrival))


def _busy_s(instance: SimInstance) -> float:
    counters = instance.counters
    return counters.prefill_s + counters.switch_s


@dataclass(frozen=True)
class Absorb:
    start_s: float
    peak_backlog_tokens: int
    absorbed_s: float | None  # from the burst's start; None: not before the next burst


def absorb_times(samples: Sequence[Sample], starts: Sequence[float], *,
                 slack_tokens: int = 2048, lookback_s: float = 5.0) -> list[Absorb]:  # fmt: skip
    """How long each burst's prefill backlog took to drain.

    The level before a burst is the highest backlog sampled in the
    ``lookback_s`` before it; the burst is absorbed at the first sample after
    its start where the backlog is back within ``slack_tokens`` of that level
    (0 s when it never rose past it), and not absorbed (``None``) when that
    happens only after the next burst started.
    """
    out = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else float("inf")
        before = [s.backlog_tokens for s in samples if start - lookback_s <= s.t_s < start]
        level = (max(before) if before else 0) + slack_tokens
        window = [s for s in samples if start <= s.t_s < end]
        peak = max((s.backlog_tokens for s in window), default=0)
        absorbed: float | None = 0.0
        if peak > level:
            absorbed = None
            risen = False
            for s in window:
                risen = risen or s.backlog_tokens > level
                if risen and s.backlog_tokens <= level:
                    absorbed = s.t_s - start
                    break
        out.append(Absorb(start, peak, absorbed))
    return out
