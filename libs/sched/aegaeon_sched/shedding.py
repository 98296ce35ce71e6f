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

With ``max_wait_s`` a request whose deadline passed while it waited is *late*:
it waits on, until ``max_wait_s`` after its arrival, in its class's late line,
which gets room only after every class's on-time waiters (first come, first
served within it). So on-time requests keep their chance to meet their TTFT,
and a burst's late requests are still served once it passes, instead of each
being a 429 that a closed-loop client turns into a new request at once.

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
    """See the module docstring.

    ``wait_all``: every class waits for room past its fraction (until its
    first-token deadline), not only the classes marked ``defer``. Each class
    waits in its own line, earliest deadline first; room goes to the highest
    class first, so a lower class at the head never holds a higher one back.
    ``max_wait_s``: a request waits that long after its arrival (None: until its
    first-token deadline); past its deadline it waits late, behind every on-time
    waiter (the module docstring): fewer refusals, so fewer retries from clients
    that ignore ``Retry-After``, without taking room from requests that can still
    meet their TTFT.
    """

    def __init__(self, classes: SLOClasses, max_deferred: int = DEFAULT_MAX_DEFERRED,
                 *, wait_all: bool = False, max_wait_s: float | None = None) -> None:  # fmt: skip
        if max_deferred < 0:
            raise ValueError("max_deferred must be >= 0")
        if max_wait_s is not None and not max_wait_s > 0:
            raise ValueError("max_wait_s must be > 0")
        self.classes = classes
        self.max_deferred = max_deferred
        self.wait_all = wait_all
        self.max_wait_s = max_wait_s
        # per class (by rank) its on-time line, (when its wait on time ends: its
        # first-token deadline, or its give-up time if earlier; seq, request id), and
        # its late line, (give-up time, seq, request id)
        self._lines: list[list[tuple[float, int, str]]] = [[] for _ in classes.classes]
        self._late: list[list[tuple[float, int, str]]] = [[] for _ in classes.classes]
        self._deferred: dict[str, Request] = {}
        self._seq = itertools.count()
        self.num_deferred = 0  # ever
        self.refused: dict[str, int] = dict.fromkeys(classes.names, 0)

    @classmethod
    def one_class(cls, ttft_s: float, tbt_s: float, max_deferred: int = DEFAULT_MAX_DEFERRED,
                  max_wait_s: float | None = None) -> Shedder:  # fmt: skip
        """Classes off: one class at the whole bounds, whose requests wait for room."""
        only = SLOClass("default", 0, ttft_s, tbt_s, admit_fraction=1.0, defer=True)
        return cls(SLOClasses((only,)), max_deferred, max_wait_s=max_wait_s)

    def __len__(self) -> int:
        """Requests waiting (deferred) now."""
        return len(self._deferred)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deferred

    def fraction(self, request: Request) -> float:
        return self.classes.by_rank(request.priority).admit_fraction

    def _give_up_s(self, request: Request, cls: SLOClass) -> float:
        """When ``request``'s wait ends: ``max_wait_s`` after its arrival, else its deadline."""
        if self.max_wait_s is None:
            return first_token_deadline_s(request, cls.ttft_s)
        return request.arrival_s + self.max_wait_s

    def _waits(self, cls: SLOClass) -> bool:
        return cls.defer or self.wait_all

    def _line(self, cls: SLOClass, late: bool = False) -> list[tuple[float, int, str]]:
        line = (self._late if late else self._lines)[cls.rank]
        while line and line[0][2] not in self._deferred:
            heapq.heappop(line)  # cancelled while it waited
        return line

    def decide(self, request: Request, fits: Fits) -> Verdict:
        """What becomes of an arriving request (a deferred one is kept here)."""
        cls = self.classes.by_rank(request.priority)
        waiting = self._waits(cls) and bool(self._line(cls))  # it never overtakes its class
        if not waiting and fits(request, cls.admit_fraction):
            return Verdict.ADMIT
        if self._waits(cls) and len(self._deferred) < self.max_deferred:
            self._deferred[request.request_id] = request
            deadline = first_token_deadline_s(request, cls.ttft_s)  # its TTFT, else its class's
            on_time_until = min(deadline, self._give_up_s(request, cls))
            heapq.heappush(self._lines[cls.rank],
                           (on_time_until, next(self._seq), request.request_id))
            self.num_deferred += 1
            return Verdict.DEFER
        self.refused[cls.name] += 1
        return Verdict.REFUSE

    def release(self, fits: Fits) -> list[Request]:
        """Room was freed: the deferred requests that fit now, the on-time ones before
        the late ones, the highest class first, each line in its order; a line's first
        that does not fit stops that line (its requests leave in order)."""
        out: list[Request] = []
        for late in (False, True):
            for cls in self.classes.classes:
                line = self._line(cls, late)
                while line:
                    request = self._deferred[line[0][2]]
                    if not fits(request, cls.admit_fraction):
                        break
                    heapq.heappop(line)
                    del self._deferred[request.request_id]
                    out.append(request)
                    line = self._line(cls, late)
        return out

    def expire(self, now_s: float) -> list[Request]:
        """The deferred requests whose wait ended (their first-token deadline passed
        and ``max_wait_s`` is None or over too): out, for the caller to refuse. Those
        past their deadline with ``max_wait_s`` left move to their class's late line."""
        out: list[Request] = []
        for cls in self.classes.classes:
            line, late = self._line(cls), self._late[cls.rank]
            while line and line[0][0] <= now_s:
                _, seq, request_id = heapq.heappop(line)
                give_up = self._give_up_s(self._deferred[request_id], cls)
                if give_up > now_s:
                    heapq.heappush(late, (give_up, seq, request_id))
                else:
                    out.append(self._drop(request_id, cls))
                line = self._line(cls)
            line = self._line(cls, late=True)
            while line and line[0][0] <= now_s:
                out.append(self._drop(heapq.heappop(line)[2], cls))
                line = self._line(cls, late=True)
        return out

    def _drop(self, request_id: str, cls: SLOClass) -> Request:
        self.refused[cls.name] += 1
        return self._deferred.pop(request_id)

    def next_expiry_s(self) -> float | None:
        """When a deferred request's wait next ends or turns late (None: nothing waits)."""
        heads = [line[0][0] for cls in self.classes.classes for late in (False, True)
                 if (line := self._line(cls, late))]
        return min(heads, default=None)

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
