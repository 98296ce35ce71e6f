"""A simulated hybrid instance: a prefill instance that decodes when no prefill waits.

Beyond the paper, as the live system does it (``scheduler.prefill_decodes_when_idle``,
services/decode ``prefill_side.py``): the proxy lists prefill instances after
the decode instances as decode targets too (Algorithm 2 places a new batch on
the shortest work list, the first on ties, so a hybrid only gets batches when
it is strictly the least loaded), and a hybrid runs Algorithm 1's job queue
with strict priority: a queued prefill ends the decode turn in progress and
the instance decodes again only once its job queue is empty, planning a fresh
round (the batches served in the interrupted round go last). Prefill and
decode share one GPU: one loaded model, one prefetch in flight.

Simplification: the prefill starts when it is enqueued, not at the end of the
decode step in progress (at most one step, ~10-30 ms, early).
"""

from __future__ import annotations

import math

from aegaeon_sched import LatencyModel, RoundRobinPlanner

from aegaeon_bench.sim.aegaeon_sim import DecodeSim, Phase
from aegaeon_bench.sim.prefill_sim import PrefillSim


class HybridSim(DecodeSim):
    """The decode side of a hybrid instance; ``prefill`` is its prefill side."""

    def __init__(
        self,
        prefill: PrefillSim,
        latency: LatencyModel,
        planner: RoundRobinPlanner,
        *,
        kv_bytes_per_s: float,
        d2d_bytes_per_s: float,
        prefetch: bool = True,
    ) -> None:
        super().__init__(
            prefill.name, latency, planner, kv_bytes_per_s=kv_bytes_per_s,
            d2d_bytes_per_s=d2d_bytes_per_s, prefetch=prefetch,
        )  # fmt: skip
        self.prefill = prefill
        self.paused = False
        prefill.on_busy = self._pause
        prefill.on_idle = self._resume

    def _pause(self, now_s: float) -> None:
        """A prefill arrived (the driver advanced this instance to ``now_s``)."""
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

    def advance(self, horizon_s: float) -> float | None:
        if self.paused:
            self.wake_s = math.inf
            return None
        return super().advance(horizon_s)
