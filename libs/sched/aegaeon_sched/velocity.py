"""Token velocity (TokenScale §III-B): tokens per second of work arriving and done, by stage.

Each instance counts the tokens of its stages (``arrival``: prompt tokens
queued to prefill and KV tokens handed in to decode; ``prefill``: prompt
tokens prefilled; ``decode``: tokens decoded) and reports their rates; the
cluster's velocity of a stage is the sum over its instances
(:func:`cluster_velocity`). The proxy also counts the prompt tokens arriving
at the cluster itself on a short window (:class:`Velocity`), the leading
indicator the role policy reacts to (:mod:`aegaeon_sched.roles`): a burst
shows there before any queue has grown.

Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

STAGES = ("arrival", "prefill", "decode")
DEFAULT_WINDOW_S = 2.0


class Velocity:
    """Tokens per second over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self.total = 0  # every token ever counted

    def add(self, now_s: float, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self._events.append((now_s, num_tokens))
        self._sum += num_tokens
        self.total += num_tokens
        self._expire(now_s)

    def rate(self, now_s: float) -> float:
        """Tokens per second over the window ending at ``now_s``."""
        self._expire(now_s)
        return self._sum / self.window_s

    def _expire(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._events and self._events[0][0] <= horizon:
            self._sum -= self._events.popleft()[1]


def cluster_velocity(per_instance: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The cluster's tokens/s by stage: the sum of its instances' reports."""
    out = dict.fromkeys(STAGES, 0.0)
    for report in per_instance:
        for stage in STAGES:
            out[stage] += float(report.get(stage, 0.0))
    return out
