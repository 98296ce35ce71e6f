"""A hybrid instance's decode share: the part of its time prefills leave for decoding.

A hybrid instance (a prefill instance that decodes when no prefill waits)
gives its job queue strict priority. Two places need to know how much time
that leaves: Algorithm 2's placement (the proxy, per unit of decode share:
:meth:`~aegaeon_sched.DecodeDispatcher.set_decode_share`) and the instance's
own round planning (:meth:`~aegaeon_sched.RoundRobinPlanner.plan`'s
``decode_share``: prefills stretch a round's wall time, so its batches must
earn their tokens in less decode time).

Rule: at each observation, the busy fraction since the previous one is
``d busy_s / d t`` (``busy_s``: the instance's cumulative prefill compute
seconds), smoothed as ``busy += smoothing * (new - busy)`` with the first
value taken as is; the share is ``1 - busy``, at least :data:`MIN_SHARE`
(a planner divides by it). Observations closer than
``min_interval_s`` are ignored, so a caller may observe at every round
(the proxy observes heartbeats, every 0.5 s).
"""

from __future__ import annotations

SMOOTHING = 0.1
MIN_INTERVAL_S = 0.5
MIN_SHARE = 1e-3


class DecodeShare:
    """See the module docstring; pure (the caller passes the clock)."""

    def __init__(
        self, smoothing: float = SMOOTHING, min_interval_s: float = MIN_INTERVAL_S
    ) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.smoothing = smoothing
        self.min_interval_s = min_interval_s
        self._last: tuple[float, float] | None = None
        self._busy: float | None = None

    @property
    def share(self) -> float:
        return max(MIN_SHARE, 1.0 - (self._busy or 0.0))

    def observe(self, now_s: float, busy_s: float) -> float:
        """Note the cumulative busy seconds at ``now_s``; returns the share."""
        last = self._last
        if last is not None and now_s - last[0] < self.min_interval_s:
            return self.share
        self._last = (now_s, busy_s)
        if last is not None and now_s > last[0] and busy_s >= last[1]:
            busy = min(1.0, (busy_s - last[1]) / (now_s - last[0]))
            old = busy if self._busy is None else self._busy
            self._busy = old + self.smoothing * (busy - old)
        return self.share
