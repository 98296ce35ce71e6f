"""What the role controller observes, metered the same way by every driver.

Two drivers feed :class:`~aegaeon_sched.roles.RoleController`: the proxy holding
the roles lease (its instances' heartbeat records, the store's queues) and the
simulator (its instances' counters and its policy, every heartbeat of its clock).
Each keeps only its I/O and meters the signals (:class:`~aegaeon_sched.roles.RoleSignals`)
with a :class:`RoleMeter`:

* **arrival velocity**: prompt tokens arriving at the cluster over a short window
  (:class:`~aegaeon_sched.velocity.Velocity`, :meth:`RoleMeter.arrived` for each
  request): the leading indicator of a burst;
* **backlog**: prompt tokens waiting in the prefill queues (the driver's);
* **prefill velocity** per instance: prompt tokens per busy second once it has
  prefilled more than ``min_measured_s`` (:meth:`RoleMeter.measured`), its latency
  profile's estimate before (:func:`~aegaeon_sched.roles.estimated_prefill_velocity`,
  the driver's);
* **prefill busy share** per instance: the growth of its busy seconds between two
  heartbeats at least ``beat_every_s`` apart (:meth:`RoleMeter.beat`); a counter
  that went back (the instance restarted) starts over;
* **decode demand** per instance: Eq. 3's ``S`` (the driver's).

What a busy second is, is the driver's: the proxy reads an instance's record,
which carries the seconds it prefilled (``load.prefill_s``); the simulator adds
the seconds its instance spent switching models (``switch_s``), which at H800
scale take ten times a prefill's compute.

Pure: the time and the counters are passed in.
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
        return RoleSignals(arrival_tokens_per_s=arrivals, backlog_tokens=backlog_tokens,
                           prefill_velocity=dict(prefill_velocity),
                           decode_demand=dict(decode_demand),
                           prefill_busy=dict(self.busy))  # fmt: skip
