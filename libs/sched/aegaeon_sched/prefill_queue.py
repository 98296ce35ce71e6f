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
from dataclasses import dataclass, field

from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.priority import STANDARD, first_token_deadline_s
from aegaeon_sched.request import Request

MAX_GPSIZE = 8


@dataclass
class PrefillGroup:
    group_id: int
    model: str
    pending: list[Request] = field(default_factory=list)
    running: Request | None = None
    num_added: int = 0
    priority: int = STANDARD  # the SLO class of its requests (0: the highest)
    key_s: float = 0.0  # its place in the queue: the opening request's first-token deadline

    def is_empty(self) -> bool:
        return not self.pending and self.running is None


class PrefillQueue:
    """One prefill instance's queue of groups in key order (see the module docstring).

    ``default_ttft_s``: the TTFT of a request that carries none (its key is
    ``arrival + default_ttft_s``); both sides of a mirror use the same.
    """

    def __init__(self, max_group_size: int = MAX_GPSIZE, default_ttft_s: float = 0.0) -> None:
        self.max_group_size = max_group_size
        self.default_ttft_s = default_ttft_s
        self._groups: list[PrefillGroup] = []  # by key_s; equal keys in insertion order
        self._by_id: dict[int, PrefillGroup] = {}
        self._group_of: dict[str, PrefillGroup] = {}
        self._running: PrefillGroup | None = None  # the group whose request runs
        self.loaded_model: str | None = None
        self._running_since_s: float = 0.0

    def __len__(self) -> int:
        """Requests queued or running."""
        return len(self._group_of)

    def __iter__(self) -> Iterator[PrefillGroup]:
        return iter(self._groups)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._group_of

    def key_of(self, request: Request) -> float:
        """Where a group opened by ``request`` stands: its first-token deadline."""
        return first_token_deadline_s(request, self.default_ttft_s)

    def open_group(self, model: str, priority: int = STANDARD) -> PrefillGroup | None:
        """The first group of ``model`` and class ``priority`` that may still take requests."""
        for group in self._groups:
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
            at = bisect.bisect_right([g.key_s for g in self._groups], key)
            self._groups.insert(at, group)
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
        for group in self._groups:
            if group.pending:
                return group, group.pending[0]
        return None

    def running(self) -> Request | None:
        return self._running.running if self._running is not None else None

    @property
    def running_since_s(self) -> float:
        """When the running request started (meaningful while one runs)."""
        return self._running_since_s

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
        if self._running is not None and self._running is not group:
            self._running.running = None  # a lost finish: only one request runs at a time
            self._drop_if_empty(self._running)
        group.running = req
        self._running = group
        self.loaded_model = group.model
        self._running_since_s = now_s
        return req

    def finish(self, request_id: str) -> None:
        """The running request completed; its group vanishes once empty."""
        group = self._group_of.pop(request_id)
        if group.running is not None and group.running.request_id == request_id:
            group.running = None
            if self._running is group:
                self._running = None
        self._drop_if_empty(group)

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
            self._groups.remove(group)
            del self._by_id[group.group_id]

    def pending_tokens(self) -> int:
        """Prompt tokens waiting (not running): the queue's backlog."""
        return sum(r.prompt_len for g in self._groups for r in g.pending)

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
            total += max(0.0, est - (now_s - self._running_since_s))
            current = self._running.model
        for group in self._groups:
            if group.key_s > before_key_s:
                break
            if not group.pending:
                continue
            if group.model != current:
                total += latency.switch_s(group.model)
            current = group.model
            for req in group.pending:
                total += latency.prefill_one_s(req.switch_unit, req.prompt_len)
        return total
