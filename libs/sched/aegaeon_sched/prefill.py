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
running is removed at once; requests run one at a time (one running request
per queue), from the front group.

Past the paper, SLO classes (:mod:`aegaeon_sched.priority`): a group also
holds one class (``priority``) and stands in the queue at its *key*, the
first-token deadline of the request that opened it; groups are kept in key
order (a new group goes after every group with an earlier or equal key) and
a group's pending requests in deadline order, so the front group is the one
whose deadline comes first. With one class and one TTFT the key is arrival
order and a new group always goes to the tail: the paper's queue. Between
two requests a more urgent group that arrived meanwhile goes first (the
running request is never interrupted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.prefill_queue import MAX_GPSIZE, PrefillGroup, PrefillQueue
from aegaeon_sched.request import InstanceId, NoInstance, Request

__all__ = ["MAX_GPSIZE", "PrefillDispatcher", "PrefillGroup", "PrefillJob", "PrefillQueue"]


@dataclass(frozen=True)
class PrefillJob:
    """The next request to prefill on an instance, and whether a switch precedes it."""

    instance: InstanceId
    group_id: int
    request: Request
    needs_switch: bool
    estimate_s: float


class PrefillDispatcher:
    """The proxy's global view of every prefill instance's queue (Algorithm 1)."""

    def __init__(
        self,
        instances: Sequence[InstanceId],
        latency: LatencyModel,
        *,
        max_group_size: int = MAX_GPSIZE,
        next_group_id: int = 0,
        default_ttft_s: float = 0.0,
    ) -> None:
        """``next_group_id``: the id the next new group gets (then +1 each); a
        replica of the proxy layer starts it at a fresh random id
        (:mod:`aegaeon_sched.shared`). ``default_ttft_s``: the TTFT of a
        request that carries none (:class:`PrefillQueue`)."""
        if not instances:
            raise ValueError("Algorithm 1 needs at least one prefill instance")
        self.latency = latency
        self.queues: dict[InstanceId, PrefillQueue] = {
            i: PrefillQueue(max_group_size=max_group_size, default_ttft_s=default_ttft_s)
            for i in instances
        }
        self._instance_of: dict[str, InstanceId] = {}
        self._next_group_id = next_group_id
        # Instances that take no new work (draining; restarting): their queues
        # still run, nothing joins them.
        self.paused: set[InstanceId] = set()
        # Instances whose role is not prefill now (aegaeon_sched.roles): the same,
        # kept apart from ``paused`` so a drain and a role change never undo each other.
        self.standby: set[InstanceId] = set()

    def takes_work(self, instance: InstanceId) -> bool:
        return instance not in self.paused and instance not in self.standby

    def instance_of(self, request_id: str) -> InstanceId | None:
        return self._instance_of.get(request_id)

    def can_dispatch(self) -> bool:
        """Some instance takes new requests."""
        return any(self.takes_work(i) for i in self.queues)

    def dispatch(self, request: Request, now_s: float) -> tuple[InstanceId, int]:
        """Choose (instance, group id) for a new request and record it.

        Paused instances (and those in standby) are skipped; raises
        :class:`NoInstance` when no instance takes work.

        With SLO classes an open group must hold the request's class too, and
        "least loaded" counts the work that runs before the new group (the
        groups with earlier keys): an interactive request goes where the least
        interactive work waits. With one class that is every group (the paper).
        """
        if not self.can_dispatch():
            raise NoInstance("every prefill instance is paused")
        open_queues = [(i, q) for i, q in self.queues.items() if self.takes_work(i)]
        # Lines 4-8: an open group of the model (and class) on any instance wins.
        for instance, queue in open_queues:
            group = queue.open_group(request.switch_unit, request.priority)
            if group is not None:
                queue.add(request, group.group_id)
                self._instance_of[request.request_id] = instance
                return instance, group.group_id
        # Lines 9-13: a new group at the tail (its key's place) of the least-loaded
        # queue (first instance on ties, as in the paper's strict '<').
        best, best_load = None, float("inf")
        for instance, queue in open_queues:
            load = queue.load_s(self.latency, now_s, queue.key_of(request))
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
        estimate = self.latency.prefill_one_s(request.switch_unit, request.prompt_len)
        return PrefillJob(instance, group.group_id, request, needs_switch, estimate)

    def on_started(self, instance: InstanceId, request_id: str, now_s: float) -> None:
        """The instance reports it began ``request_id`` (live mirror path)."""
        queue = self.queues[instance]
        if request_id in queue and queue.running() is None:
            queue.start(request_id, now_s)

    def on_done(self, instance: InstanceId, request_id: str, now_s: float) -> Request | None:
        """The request's prefill completed; returns it (``None`` if unknown)."""
        self._instance_of.pop(request_id, None)
        return self.queues[instance].done(request_id, now_s)

    def backlog_tokens(self) -> int:
        """Prompt tokens waiting for prefill on every instance."""
        return sum(q.pending_tokens() for q in self.queues.values())

    def cancel(self, request_id: str) -> InstanceId | None:
        """Remove a request wherever it is queued; the instance it was on."""
        instance = self._instance_of.pop(request_id, None)
        if instance is not None:
            self.queues[instance].remove(request_id)
        return instance
