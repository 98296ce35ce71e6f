"""Grouped prefill scheduling (Algorithm 1).

:class:`PrefillQueue` is one prefill instance's job queue of groups. The same
class lives on both sides: the proxy keeps one per instance inside
:class:`PrefillDispatcher` (the global view Algorithm 1 needs) and each
instance keeps a mirror, applying the same ``add(request, group_id)`` calls in
the same order (an unknown group id opens a group at the tail), then executes
with :meth:`PrefillQueue.peek` / :meth:`start` / :meth:`finish`.

Invariants: a group holds requests of one model; ``num_added`` counts every
request ever added (executing one does not decrease it), so a group is open
while ``num_added < max_group_size``; a group with nothing pending and nothing
running is removed at once; requests run one at a time from the front group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.request import InstanceId, NoInstance, Request

MAX_GPSIZE = 8


@dataclass
class PrefillGroup:
    group_id: int
    model: str
    pending: list[Request] = field(default_factory=list)
    running: Request | None = None
    num_added: int = 0

    def is_empty(self) -> bool:
        return not self.pending and self.running is None


@dataclass(frozen=True)
class PrefillJob:
    """The next request to prefill on an instance, and whether a switch precedes it."""

    instance: InstanceId
    group_id: int
    request: Request
    needs_switch: bool
    estimate_s: float


class PrefillQueue:
    """One prefill instance's FIFO of groups (see the module docstring)."""

    def __init__(self, max_group_size: int = MAX_GPSIZE) -> None:
        self.max_group_size = max_group_size
        self._groups: list[PrefillGroup] = []
        self._by_id: dict[int, PrefillGroup] = {}
        self._group_of: dict[str, PrefillGroup] = {}
        self.loaded_model: str | None = None
        self._running_since_s: float = 0.0

    def __len__(self) -> int:
        """Requests queued or running."""
        return len(self._group_of)

    def __iter__(self) -> Iterator[PrefillGroup]:
        return iter(self._groups)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._group_of

    def open_group(self, model: str) -> PrefillGroup | None:
        """The first group of ``model`` that may still take requests."""
        for group in self._groups:
            if group.model == model and group.num_added < self.max_group_size:
                return group
        return None

    def add(self, request: Request, group_id: int) -> PrefillGroup:
        """Add to group ``group_id``; an unknown id opens a new group at the tail."""
        if request.request_id in self._group_of:
            raise ValueError(f"request {request.request_id!r} is already queued")
        group = self._by_id.get(group_id)
        if group is None:
            group = PrefillGroup(group_id, request.model)
            self._groups.append(group)
            self._by_id[group_id] = group
        elif group.model != request.model:
            raise ValueError(f"group {group_id} holds {group.model!r}, not {request.model!r}")
        group.pending.append(request)
        group.num_added += 1
        self._group_of[request.request_id] = group
        return group

    def peek(self) -> tuple[PrefillGroup, Request] | None:
        """The front group's next pending request (``None`` if busy or empty)."""
        if not self._groups:
            return None
        front = self._groups[0]
        if front.running is not None or not front.pending:
            return None
        return front, front.pending[0]

    def running(self) -> Request | None:
        return self._groups[0].running if self._groups else None

    @property
    def running_since_s(self) -> float:
        """When the running request started (meaningful while one runs)."""
        return self._running_since_s

    def start(self, request_id: str, now_s: float) -> Request:
        """Mark a pending request as executing (it becomes the loaded model's job)."""
        group = self._group_of[request_id]
        for i, req in enumerate(group.pending):
            if req.request_id == request_id:
                del group.pending[i]
                break
        else:
            raise ValueError(f"request {request_id!r} is not pending")
        # Execution is at the front; a start elsewhere (a mirror out of sync)
        # moves the group there so the queue still describes reality.
        if self._groups[0] is not group:
            self._groups.remove(group)
            self._groups.insert(0, group)
        group.running = req
        self.loaded_model = group.model
        self._running_since_s = now_s
        return req

    def finish(self, request_id: str) -> None:
        """The running request completed; its group vanishes once empty."""
        group = self._group_of.pop(request_id)
        if group.running is not None and group.running.request_id == request_id:
            group.running = None
        self._drop_if_empty(group)

    def remove(self, request_id: str) -> bool:
        """Cancel: take the request out wherever it is; ``False`` if unknown."""
        group = self._group_of.pop(request_id, None)
        if group is None:
            return False
        if group.running is not None and group.running.request_id == request_id:
            group.running = None
        else:
            group.pending = [r for r in group.pending if r.request_id != request_id]
        self._drop_if_empty(group)
        return True

    def _drop_if_empty(self, group: PrefillGroup) -> None:
        if group.is_empty():
            self._groups.remove(group)
            del self._by_id[group.group_id]

    def load_s(self, latency: LatencyModel, now_s: float) -> float:
        """Estimated time to finish every queued group (Alg. 1, line 9).

        Sums the prefill estimates of the remaining requests, the unfinished
        part of the running one, and one switch at each change of model along
        the queue, starting from the loaded model.
        """
        total = 0.0
        current = self.loaded_model
        for group in self._groups:
            if group.running is not None:
                est = latency.prefill_one_s(group.model, group.running.prompt_len)
                total += max(0.0, est - (now_s - self._running_since_s))
            elif group.model != current:
                total += latency.switch_s(group.model)
            current = group.model
            for req in group.pending:
                total += latency.prefill_one_s(req.model, req.prompt_len)
        return total


class PrefillDispatcher:
    """The proxy's global view of every prefill instance's queue (Algorithm 1)."""

    def __init__(
        self,
        instances: Sequence[InstanceId],
        latency: LatencyModel,
        *,
        max_group_size: int = MAX_GPSIZE,
        next_group_id: int = 0,
    ) -> None:
        """``next_group_id``: the id the next new group gets (then +1 each); a
        replica of the proxy layer starts it at a fresh random id
        (:mod:`aegaeon_sched.shared`)."""
        if not instances:
            raise ValueError("Algorithm 1 needs at least one prefill instance")
        self.latency = latency
        self.queues: dict[InstanceId, PrefillQueue] = {
            i: PrefillQueue(max_group_size) for i in instances
        }
        self._instance_of: dict[str, InstanceId] = {}
        self._next_group_id = next_group_id
        # Instances that take no new work (draining; restarting): their queues
        # still run, nothing joins them.
        self.paused: set[InstanceId] = set()

    def instance_of(self, request_id: str) -> InstanceId | None:
        return self._instance_of.get(request_id)

    def can_dispatch(self) -> bool:
        """Some instance takes new requests."""
        return any(i not in self.paused for i in self.queues)

    def dispatch(self, request: Request, now_s: float) -> tuple[InstanceId, int]:
        """Choose (instance, group id) for a new request and record it.

        Paused instances are skipped; raises :class:`NoInstance` when every
        instance is paused.
        """
        if not self.can_dispatch():
            raise NoInstance("every prefill instance is paused")
        open_queues = [(i, q) for i, q in self.queues.items() if i not in self.paused]
        # Lines 4-8: an open group of the model on any instance wins.
        for instance, queue in open_queues:
            group = queue.open_group(request.model)
            if group is not None:
                queue.add(request, group.group_id)
                self._instance_of[request.request_id] = instance
                return instance, group.group_id
        # Lines 9-13: a new group at the tail of the least-loaded queue
        # (first instance on ties, as in the paper's strict '<').
        best, best_load = None, float("inf")
        for instance, queue in open_queues:
            load = queue.load_s(self.latency, now_s)
            if load < best_load:
                best, best_load = instance, load
        assert best is not None
        group_id = self._next_group_id
        self._next_group_id += 1
        self.queues[best].add(request, group_id)
        self._instance_of[request.request_id] = best
        return best, group_id

    def next_job(self, instance: InstanceId, now_s: float) -> PrefillJob | None:
        """Line 15: take the front group's next request (marks it running)."""
        queue = self.queues[instance]
        head = queue.peek()
        if head is None:
            return None
        group, request = head
        needs_switch = queue.loaded_model != group.model
        queue.start(request.request_id, now_s)
        estimate = self.latency.prefill_one_s(request.model, request.prompt_len)
        return PrefillJob(instance, group.group_id, request, needs_switch, estimate)

    def on_started(self, instance: InstanceId, request_id: str, now_s: float) -> None:
        """The instance reports it began ``request_id`` (live mirror path)."""
        queue = self.queues[instance]
        if request_id in queue and queue.running() is None:
            queue.start(request_id, now_s)

    def on_done(self, instance: InstanceId, request_id: str, now_s: float) -> Request | None:
        """The request's prefill completed; returns it (``None`` if unknown)."""
        queue = self.queues[instance]
        self._instance_of.pop(request_id, None)
        if request_id not in queue:
            return None
        running = queue.running()
        if running is None or running.request_id != request_id:
            # The start report was lost or never sent: it ran all the same.
            running = queue.start(request_id, now_s)
        queue.finish(request_id)
        return running

    def cancel(self, request_id: str) -> InstanceId | None:
        """Remove a request wherever it is queued; the instance it was on."""
        instance = self._instance_of.pop(request_id, None)
        if instance is not None:
            self.queues[instance].remove(request_id)
        return instance
