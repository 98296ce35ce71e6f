"""Per-request simulation state and the batched-step arithmetic shared by instances.

Token times are kept as *chunks* ``(first_s, period_s, count)``: a run of
``count`` steps of one batch whose composition did not change emits a token
for each member at ``first_s + j * period_s``. Instances advance a batch a
whole chunk at a time (until a member finishes, a new member becomes ready,
the turn's quota ends, or the time horizon is reached), which keeps a
simulated hour of a 16-GPU cluster to seconds of Python.

Within a chunk the step time is held at its value at the chunk's start;
contexts grow by one token per member per step, which changes an H800 step
by well under 1% over a chunk, and chunks are recomputed at every event.
"""

from __future__ import annotations

import itertools
import math

from aegaeon_sched import Request, RequestTrace


class SimRequest:
    """A request in flight. Plain attributes (no properties): the hot loops read them."""

    __slots__ = (
        "chunks", "finished_s", "generated", "output_len", "prompt_len", "ready_s", "request",
    )  # fmt: skip

    def __init__(self, request: Request) -> None:
        assert request.oracle_output_len is not None
        self.request = request
        self.prompt_len = request.prompt_len
        self.output_len = request.oracle_output_len
        self.ready_s = math.inf  # may join a step starting at or after this time
        self.generated = 0
        self.chunks: list[tuple[float, float, int]] = []
        self.finished_s: float | None = None

    @property
    def remaining(self) -> int:
        return self.output_len - self.generated

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated

    def emit(self, first_s: float, period_s: float, count: int) -> None:
        self.chunks.append((first_s, period_s, count))
        self.generated += count

    def trace(self) -> RequestTrace:
        times: list[float] = []
        for first, period, n in self.chunks:
            # count() accumulates in C; the float drift over a chunk is ~1e-13 s.
            times.extend(itertools.islice(itertools.count(first, period), n))
        return RequestTrace(self.request.request_id, self.request.arrival_s, self.output_len, times)


def steps_within(clock: float, step_s: float, horizon_s: float) -> int:
    """Whole steps starting at ``clock`` that end by ``horizon_s``."""
    if step_s <= 0 or math.isinf(horizon_s):
        return 1 << 30
    return max(0, math.floor((horizon_s - clock) / step_s + 1e-9))


def steps_until(clock: float, step_s: float, limit_s: float) -> int:
    """Steps that *start* before ``limit_s`` (at least one if ``clock < limit_s``)."""
    if limit_s <= clock:
        return 0
    if step_s <= 0 or math.isinf(limit_s):
        return 1 << 30
    return max(1, math.ceil((limit_s - clock) / step_s - 1e-9))
