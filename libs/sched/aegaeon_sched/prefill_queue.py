"""One prefill instance's job queue of groups (Algorithm 1), and the group.

:class:`PrefillQueue` lives on both sides: the proxy keeps one per instance
inside :class:`~aegaeon_sched.prefill.PrefillDispatcher` and each instance
keeps a mirror, applying the same ``add(request, group_id)`` calls in the
same order (an unknown group id opens a group), then executes with
:meth:`PrefillQueue.peek` / :meth:`~PrefillQueue.start` /
:meth:`~PrefillQueue.finish`. Invariants and the order of groups (SLO
classes: earliest deadline first): :mod:`aegaeon_sched.prefill`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

import msgspec

from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.priority import STANDARD, first_token_deadline_s
from aegaeon_sched.request import Request

MAX_GPSIZE = 8


class PrefillGroup(msgspec.Struct, array_like=True):
    """Requests of one model (unit) and SLO class prefilled back to back (stored as
    the array of its fields in this order)."""

    group_id: int
    model: str
    num_added: int = 0
    running: Request | None = None
    pending: list[Request] = msgspec.field(default_factory=list)
    key_s: float = 0.0  # its place in the queue: the opening request's first-token deadline
    priority: int = STANDARD  # the SLO class of its requests (0: the highest)

    def is_empty(self) -> bool:
        return not self.pending and self.running is None


class PrefillQueue(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True,
                   dict=True):  # fmt: skip
    """One prefill instance's queue of groups in key order (see the module docstring).

    It is its own stored form (:mod:`aegaeon_sched.shared`): msgpack of the array
    ``[loaded_model, running_since_s, groups, max_group_size, default_ttft_s]``
    (the settings left out when they are the defaults) decodes into the queue
    itself; the indexes by id are built on decoding (:meth:`__post_init__`).

    ``default_ttft_s``: the TTFT of a request that carries none (its key is
    ``arrival + default_ttft_s``); both sides of a mirror use the same.
    """

    loaded_model: str | None = None
    running_since_s: float = 0.0  # when the running request started (while one runs)
    groups: list[PrefillGroup] = msgspec.field(default_factory=list)  # by key_s, then added
    max_group_size: int = MAX_GPSIZE
    default_ttft_s: float = 0.0

    def __post_init__(self) -> None:
        self._by_id: dict[int, PrefillGroup] = {g.group_id: g for g in self.groups}
        self._group_of = {r.request_id: g for g in self.groups for r in g.pending}
        self._running: PrefillGroup | None = None  # the group whose request runs
        for group in self.groups:
            if group.is_empty():
                raise ValueError(f"group {group.group_id} of model {group.model!r} holds "
                                 "no request")
            if group.running is not None:
                self._group_of[group.running.request_id] = group
                self._running = group

    def __len__(self) -> int:
        """Requests queued or running."""
        return len(self._group_of)

    def __iter__(self) -> Iterator[PrefillGroup]:
        return iter(self.groups)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._group_of

    def key_of(self, request: Request) -> float:
        """Where a group opened by ``request`` stands: its first-token deadline."""
        return first_token_deadline_s(request, self.default_ttft_s)

    def open_group(self, model: str, priority: int = STANDARD) -> PrefillGroup | None:
        """The first group of ``model`` and class ``priority`` that may still take requests."""
        for group in self.groups:
            if (group.model == model and group.priority == priority
                    and group.num_added < self.max_group_size):  # fmt: skip
                return group
        return None

    def add(self, request: Request, group_id: int, *, key_s: float | None = None) -> PrefillGroup:
        """Add to group ``group_id``; an unknown id opens a new group at its key's place
        (``key_s``, default: the request's first-token deadline)."""
        if request.request_id in self._group_of:
            raise ValueError(f"request {request.request_id!r} is already queued")
        group = self._by_id.get(group_id)
        if group is None:
            key = self.key_of(request) if key_s is None else key_s
            group = PrefillGroup(group_id, request.switch_unit, priority=request.priority,
                                 key_s=key)
            at = bisect.bisect_right([g.key_s for g in self.groups], key)
            self.groups.insert(at, group)
            self._by_id[group_id] = group
        elif group.model != request.switch_unit:
            raise ValueError(f"group {group_id} holds {group.model!r}, not "
                             f"{request.switch_unit!r}")
        deadline = self.key_of(request)
        at = bisect.bisect_right([self.key_of(r) for r in group.pending], deadline)
        group.pending.insert(at, request)
        group.num_added += 1
        self._group_of[request.request_id] = group
        return group

    def group_key_s(self, group_id: int) -> float:
        """Where group ``group_id`` stands in the queue (its key)."""
        return self._by_id[group_id].key_s

    def peek(self) -> tuple[PrefillGroup, Request] | None:
        """The next request to run: the front group's first (``None`` if one runs or empty)."""
        if self._running is not None:
            return None
        for group in self.groups:
            if group.pending:
                return group, group.pending[0]
        return None

    def running(self) -> Request | None:
        return self._running.running if self._running is not None else None

    def start(self, request_id: str, now_s: float) -> Request:
        """Mark a pending request as executing (it becomes the loaded model's job).

        A start of another request than :meth:`peek`'s (a mirror out of sync)
        is taken as it is: the queue then describes what runs.
        """
        group = self._group_of[request_id]
        for i, req in enumerate(group.pending):
            if req.request_id == request_id:
                del group.pending[i]
                break
        else:
            raise ValueError(f"request {request_id!r} is not pending")
        previous = self._running
        if previous is not None and previous.running is not None:
            # a lost finish (only one request runs at a time): the one that ran leaves
            del self._group_of[previous.running.request_id]
            previous.running = None
            if previous is not group:
                self._drop_if_empty(previous)
        group.running = req
        self._running = group
        self.loaded_model = group.model
        self.running_since_s = now_s
        return req

    def finish(self, request_id: str) -> None:
        """The running request completed; its group vanishes once empty."""
        group = self._group_of.pop(request_id)
        if group.running is not None and group.running.request_id == request_id:
            group.running = None
            if self._running is group:
                self._running = None
        self._drop_if_empty(group)

    def done(self, request_id: str, now_s: float) -> Request | None:
        """``request_id`` was prefilled: it leaves, started first if its start was
        not seen (a lost report: it ran all the same); ``None`` if unknown."""
        if request_id not in self:
            return None
        running = self.running()
        if running is None or running.request_id != request_id:
            running = self.start(request_id, now_s)
        self.finish(request_id)
        return running

    def remove(self, request_id: str) -> bool:
        """Cancel: take the request out wherever it is; ``False`` if unknown."""
        group = self._group_of.pop(request_id, None)
        if group is None:
            return False
        if group.running is not None and group.running.request_id == request_id:
            group.running = None
            if self._running is group:
                self._running = None
        else:
            group.pending = [r for r in group.pending if r.request_id != request_id]
        self._drop_if_empty(group)
        return True

    def _drop_if_empty(self, group: PrefillGroup) -> None:
        if group.is_empty() and self._by_id.get(group.group_id) is group:
            self.groups.remove(group)
            del self._by_id[group.group_id]

    def pending_tokens(self) -> int:
        """Prompt tokens waiting (not running): the queue's backlog."""
        return sum(r.prompt_len for g in self.groups for r in g.pending)

    def load_s(self, latency: LatencyModel, now_s: float, before_key_s: float = math.inf) -> float:
        """Estimated time to finish every queued group (Alg. 1, line 9), or, with
        ``before_key_s``, those that run before a new group of that key.

        Sums the unfinished part of the running request, the prefill estimates
        of the pending requests and one switch at each change of model along
        the queue, starting from the loaded model.
        """
        total = 0.0
        current = self.loaded_model
        if self._running is not None and self._running.running is not None:
            est = latency.prefill_one_s(self._running.model, self._running.running.prompt_len)
            total += max(0.0, est - (now_s - self.running_since_s))
            current = self._running.model
        for group in self.groups:
            if group.key_s > before_key_s:
                break
            if not group.pending:
                continue
            if group.model != current:
                total += latency.switch_s(group.model)
            current = group.model
            for req in group.pending:  # (of the group's unit: add keeps them so)
                total += latency.prefill_one_s(group.model, req.prompt_len)
        return total
