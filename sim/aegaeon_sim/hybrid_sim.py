"""A simulated hybrid instance: a prefill instance that decodes when no prefill waits.

Beyond the paper, as the live system does it (``scheduler.prefill_decodes_when_idle``,
``aegaeon_runtime.prefill.loop``): the proxy lists prefill instances after
the decode instances as decode targets too; Algorithm 2 places a new batch on
the work list with the fewest batches per unit of decode share, which the
proxy sets from each hybrid's heartbeats (``1 -`` its prefill busy fraction;
:mod:`aegaeon_sim.shares`), and a hybrid runs Algorithm 1's job queue
with strict priority: a queued prefill ends the decode turn in progress and
the instance decodes again only once its job queue is empty, planning a fresh
round. Its :class:`~aegaeon_sched.RoundController` is the live hybrid's: a
waiting prefill cuts the round (the batches already served since the last
complete round go last), and rounds are planned for its decode share
(:class:`~aegaeon_sched.DecodeShare` over its prefill compute seconds).
Prefill and decode share one GPU: one loaded model, one prefetch in flight.

Simplification: the prefill starts when it is enqueued, not at the end of the
decode step in progress (at most one step, ~10-30 ms, early).
"""

from __future__ import annotations

import math

from aegaeon_sched import DecodeShare, LatencyModel, RoundController, RoundRobinPlanner

from aegaeon_sim.decode_sim import DecodeSim, Phase
from aegaeon_sim.prefill_sim import PrefillSim
from aegaeon_sim.switching import InstanceCosts


class HybridSim(DecodeSim):
    """The decode side of a hybrid instance; ``prefill`` is its prefill side."""

    def __init__(
        self,
        prefill: PrefillSim,
        latency: LatencyModel,
        planner: RoundRobinPlanner,
        *,
        kv_bytes_per_s: float,
        costs: InstanceCosts,
        prefetch: bool = True,
        estimator: LatencyModel | None = None,
        rounds: RoundController | None = None,
    ) -> None:
        super().__init__(
            prefill.name, latency, planner, kv_bytes_per_s=kv_bytes_per_s, costs=costs,
            prefetch=prefetch, estimator=estimator,
            rounds=rounds or RoundController(planner, share=DecodeShare()),
        )  # fmt: skip
        self.prefill = prefill
        self.paused = False
        prefill.on_busy = self._pause
        prefill.on_idle = self._resume

    def _pause(self, now_s: float) -> None:
        """A prefill arrived (the driver advanced this instance to ``now_s``): it goes
        first, the round is cut (what the controller rules for a waiting prefill)."""
        self.meter.end(self.clock)
        self.paused = True
        self.prefill.loaded, self.prefill.prefetch = self.loaded, self.prefetch
        self.wake_s = math.inf

    def _resume(self, now_s: float) -> None:
        """The job queue is empty: decode again from ``now_s``, a fresh round."""
        self.paused = False
        self.loaded, self.prefetch = self.prefill.loaded, self.prefill.prefetch
        self.clock = max(self.clock, now_s)
        self.phase = Phase.ROUND_START
        self.wake_s = self.clock

    def prefill_busy_s(self) -> float:
        return self.prefill.compute_s

    def advance(self, horizon_s: float) -> float | None:
        if self.paused:
            self.wake_s = math.inf
            return None
        return super().advance(horizon_s)
