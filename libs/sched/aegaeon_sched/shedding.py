"""Shedding under overload by SLO class: the lowest class first, never the highest first.

A node bounds the work it has accepted (the proxy's admission: queued
prefill tokens and reserved KV blocks, in total and per model). Past the
paper, each SLO class (:mod:`aegaeon_sched.priority`) may fill its own
fraction of those bounds (:attr:`~aegaeon_sched.priority.SLOClass.admit_fraction`;
defaults: interactive 1.25, standard 1.0, batch 0.5). An arriving request
that does not fit under its class's fraction is

- **deferred** when its class allows it (``defer``; by default only
  ``batch``): it waits, earliest deadline first, until room is freed
  (:meth:`Shedder.release`), as long as fewer than ``max_deferred`` wait;
- **refused** otherwise (the proxy answers 429 with ``Retry-After``).

So as load grows, batch requests are deferred or refused while the node is
at half its bounds, standard ones at the bounds, and interactive ones only
past 1.25 times the bounds, when everything of the other classes already is.
A deferrable request also waits while others of its kind already wait (it
never overtakes them), and no longer than its first-token deadline
(:meth:`Shedder.expire`): past it the request can no longer meet its TTFT and
is refused then.

With classes off (:meth:`Shedder.one_class`) every request fills the whole
bounds and, past them, waits its turn (one TTFT: earliest deadline first is
arrival order). Waiting instead of a 429 at once is what keeps goodput under
a flood of clients that ignore ``Retry-After``: each refusal costs the node
a parse and a tokenization, and a client that retries at once makes as many
as the node can answer, on the cores the engine needs; a waiting request
costs nothing until it is admitted or expires.

Pure: the caller says what fits (``fits(request, fraction)``); no clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from enum import Enum

from aegaeon_sched.priority import SLOClass, SLOClasses, first_token_deadline_s
from aegaeon_sched.request import Request

DEFAULT_MAX_DEFERRED = 256

Fits = Callable[[Request, float], bool]
"""``fits(request, fraction)``: the request fits under ``fraction`` x each admission bound."""


class Verdict(Enum):
    ADMIT = "admit"
    DEFER = "defer"
    REFUSE = "refuse"


class Shedder:
    """See the module docstring."""

    def __init__(self, classes: SLOClasses, max_deferred: int = DEFAULT_MAX_DEFERRED) -> None:
        if max_deferred < 0:
            raise ValueError("max_deferred must be >= 0")
        self.classes = classes
        self.max_deferred = max_deferred
        self._heap: list[tuple[float, int, str]] = []  # (deadline, seq, request id)
        self._deferred: dict[str, Request] = {}
        self._seq = itertools.count()
        self.num_deferred = 0  # ever
        self.refused: dict[str, int] = dict.fromkeys(classes.names, 0)

    @classmethod
    def one_class(cls, ttft_s: float, tbt_s: float,
                  max_deferred: int = DEFAULT_MAX_DEFERRED) -> Shedder:  # fmt: skip
        """Classes off: one class at the whole bounds, whose requests wait for room."""
        only = SLOClass("default", 0, ttft_s, tbt_s, admit_fraction=1.0, defer=True)
        return cls(SLOClasses((only,)), max_deferred)

    def __len__(self) -> int:
        """Requests waiting (deferred) now."""
        return len(self._deferred)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deferred

    def fraction(self, request: Request) -> float:
        return self.classes.by_rank(request.priority).admit_fraction

    def decide(self, request: Request, fits: Fits) -> Verdict:
        """What becomes of an arriving request (a deferred one is kept here)."""
        cls = self.classes.by_rank(request.priority)
        waiting = cls.defer and bool(self._deferred)
        if not waiting and fits(request, cls.admit_fraction):
            return Verdict.ADMIT
        if cls.defer and len(self._deferred) < self.max_deferred:
            self._deferred[request.request_id] = request
            due = first_token_deadline_s(request, cls.ttft_s)  # its own TTFT, else its class's
            heapq.heappush(self._heap, (due, next(self._seq),
                                        request.request_id))  # fmt: skip
            self.num_deferred += 1
            return Verdict.DEFER
        self.refused[cls.name] += 1
        return Verdict.REFUSE

    def release(self, fits: Fits) -> list[Request]:
        """Room was freed: the deferred requests that fit now, earliest deadline first;
        the first that does not fit stops the release (they leave in order)."""
        out: list[Request] = []
        while self._heap:
            _, _, request_id = self._heap[0]
            request = self._deferred.get(request_id)
            if request is None:  # cancelled while it waited
                heapq.heappop(self._heap)
                continue
            if not fits(request, self.fraction(request)):
                break
            heapq.heappop(self._heap)
            del self._deferred[request_id]
            out.append(request)
        return out

    def expire(self, now_s: float) -> list[Request]:
        """The deferred requests whose first-token deadline passed while they waited
        (it can no longer be met): out of the wait, for the caller to refuse."""
        out: list[Request] = []
        while self._heap and self._heap[0][0] <= now_s:
            _, _, request_id = heapq.heappop(self._heap)
            request = self._deferred.pop(request_id, None)
            if request is not None:  # (None: cancelled while it waited)
                self.refused[self.classes.by_rank(request.priority).name] += 1
                out.append(request)
        return out

    def next_expiry_s(self) -> float | None:
        """When the earliest deferred request's wait ends (None: nothing waits)."""
        while self._heap and self._heap[0][2] not in self._deferred:
            heapq.heappop(self._heap)  # cancelled while it waited
        return self._heap[0][0] if self._heap else None

    def cancel(self, request_id: str) -> bool:
        """The client went away while its request waited; ``False`` if it was not waiting."""
        return self._deferred.pop(request_id, None) is not None

    def snapshot(self) -> dict[str, object]:
        """For ``/v1/aegaeon/stats``: waiting now, deferred ever, refused by class."""
        return {
            "deferred": len(self._deferred),
            "deferred_total": self.num_deferred,
            "refused_by_class": dict(self.refused),
            "admit_fractions": {c.name: c.admit_fraction for c in self.classes.classes},
        }
