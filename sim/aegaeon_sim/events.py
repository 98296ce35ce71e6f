"""Simulated time: one event heap, and the instances' real loops running on it.

Each simulated instance runs its service's own compute loop
(:class:`~aegaeon_runtime.decode.loop.DecodeLoop`,
:class:`~aegaeon_runtime.prefill.loop.PrefillLoop`) unchanged, as a
`greenlet <https://greenlet.readthedocs.io>`_: a coroutine that can pause deep
inside ordinary blocking code. The loops never read a clock themselves; they
read the :class:`SimClock` they are given (the runtime's ``Clock`` port), and
wherever live time would pass (an engine step, a model switch, a sleep, a wait on
the inbox) the loop's greenlet hands control back to :class:`EventLoop`, which
resumes it when the simulated clock gets there. Everything else (the policy, the
heartbeats, the arrivals) is an event callback on the same heap.

One OS thread, no real time: a run is deterministic for its inputs, and an
instance sees exactly what a live one would between two of its own steps (the
commands that arrived meanwhile, copies that completed by then).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from greenlet import getcurrent, greenlet


class EventLoop:
    """The event heap and the simulated clock (``now``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._main = getcurrent()
        self._tasks: list[greenlet] = []
        self._until = math.inf  # where the run in progress stops

    def at(self, t_s: float, callback: Callable[[], object]) -> None:
        """Run ``callback`` once the clock reaches ``t_s`` (events at one time run in
        the order they were scheduled)."""
        heapq.heappush(self._heap, (max(t_s, self.now), next(self._seq), callback))

    def spawn(self, run: Callable[[], object]) -> None:
        """Start ``run`` (an instance's loop) as a task at the current time."""
        task = greenlet(run, parent=self._main)
        self._tasks.append(task)
        self.at(self.now, task.switch)

    def sleep(self, seconds: float) -> None:
        """Called from a task: it resumes ``seconds`` later (0: after the events due now)."""
        task = getcurrent()
        if task is self._main:
            raise RuntimeError("the event loop itself cannot wait")
        heapq.heappush(self._heap, (self.now + max(seconds, 0.0), next(self._seq), task.switch))
        self._main.switch()

    def pass_time(self, seconds: float) -> None:
        """Called from a task: ``seconds`` pass for it. When no event is due meanwhile,
        nothing else could run before it resumes: the clock moves on at once."""
        until = self.now + seconds
        heap = self._heap
        if (heap and heap[0][0] <= until) or until > self._until:
            self.sleep(seconds)
        elif getcurrent() is self._main:
            raise RuntimeError("the event loop itself cannot wait")
        else:
            self.now = until

    def suspend(self) -> None:
        """Called from a task: it resumes when some event switches back to it."""
        self._main.switch()

    def run(self, until_s: float) -> None:
        """Run every event due by ``until_s``, then set the clock there."""
        heap = self._heap
        self._until = until_s
        while heap and heap[0][0] <= until_s:
            t_s, _, callback = heapq.heappop(heap)
            self.now = t_s
            callback()
        self.now = max(self.now, until_s)

    def close(self) -> None:
        """End every task where it waits (its ``finally`` blocks run; nothing is scheduled)."""
        self._heap.clear()
        for task in self._tasks:
            if not task.dead:
                task.throw()
        self._tasks.clear()


class SimClock:
    """The runtime's ``Clock`` port on simulated time; ``advance`` is how the fakes
    (engine, switcher) make an operation take time: the calling loop pauses for it."""

    def __init__(self, events: EventLoop) -> None:
        self.events = events

    def now(self) -> float:
        return self.events.now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.events.pass_time(seconds)

    wall = now  # simulated time is the only time
    advance = sleep
