"""The role controller's signals, metered alike by its drivers.

The proxy holding the roles lease (its instances' records, the store) and the
simulator (its instances' counters, its policy) keep their I/O and meter
:class:`~aegaeon_sched.roles.RoleSignals` here: the prompt tokens arriving at the
cluster over a short window (:meth:`RoleMeter.arrived`); each instance's busy share,
the growth of its busy seconds between heartbeats ``beat_every_s`` apart
(:meth:`RoleMeter.beat`; a counter gone back, a restart, starts over), and its prefill
velocity, prompt tokens per busy second once it has prefilled over ``min_measured_s``
(:meth:`RoleMeter.measured`; before, the driver's estimate). What counts as busy, the
backlog and the decode demand are the driver's. Pure: time and counters passed in.
"""

from __future__ import annotations

from collections.abc import Mapping

from aegaeon_sched.roles import RoleSignals
from aegaeon_sched.velocity import Velocity


class RoleMeter:
    """The signals of :class:`~aegaeon_sched.roles.RoleController` (see the module)."""

    def __init__(self, *, beat_every_s: float = 0.0, min_measured_s: float = 0.0) -> None:
        self.beat_every_s = beat_every_s
        self.min_measured_s = min_measured_s
        self.arrivals = Velocity()
        self.busy: dict[str, float] = {}  # instance -> prefill busy share, last heartbeats
        self._prev: dict[str, tuple[float, float]] = {}  # instance -> (t, busy seconds)

    def arrived(self, now_s: float, prompt_tokens: int) -> None:
        self.arrivals.add(now_s, prompt_tokens)

    def beat(self, instance: str, now_s: float, busy_s: float) -> None:
        """A heartbeat of ``instance``: ``busy_s``, the seconds it has been busy since
        it started; its busy share is their growth since the last heartbeat metered."""
        prev = self._prev.get(instance)
        if prev is not None and busy_s >= prev[1]:
            if now_s - prev[0] < self.beat_every_s:
                return
            if now_s > prev[0]:
                self.busy[instance] = min(1.0, (busy_s - prev[1]) / (now_s - prev[0]))
        self._prev[instance] = (now_s, busy_s)

    def measured(self, prefill_tokens: int, prefill_s: float, busy_s: float) -> float | None:
        """Prompt tokens per busy second (``busy_s >= prefill_s``) of an instance that
        has prefilled ``prefill_tokens`` in ``prefill_s``; None before it has prefilled
        more than ``min_measured_s`` (the driver estimates it)."""
        return prefill_tokens / busy_s if prefill_s > self.min_measured_s else None

    def signals(self, now_s: float, *, backlog_tokens: int, prefill_velocity: Mapping[str, float],
                decode_demand: Mapping[str, float], arrival_tokens_per_s: float | None = None
                ) -> RoleSignals:  # fmt: skip
        """One observation; ``arrival_tokens_per_s``: default the arrivals metered here."""
        arrivals = self.arrivals.rate(now_s) if arrival_tokens_per_s is None \
            else arrival_tokens_per_s
        return RoleSignals(arrivals, backlog_tokens, dict(prefill_velocity), dict(decode_demand),
                           dict(self.busy))  # fmt: skip
