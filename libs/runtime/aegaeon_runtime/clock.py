"""The clock a worker's compute loop reads, injected so tests can drive time.

The decode and prefill loops never call :mod:`time` themselves: they ask the
:class:`Clock` they were given. :data:`SYSTEM_CLOCK` is the real one; a test
passes a fake whose ``sleep`` advances it and whose engine steps advance it
by a modelled step time (tests/unit/fake_worker.py), so a turn's quota, a
KV wait or a round's plan can be checked without waiting for them.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (durations, deadlines): ``time.perf_counter``."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (timestamps other processes read): ``time.time``."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.perf_counter()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
