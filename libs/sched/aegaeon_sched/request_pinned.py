"""Request-level auto-scaling with requests pinned to an instance at arrival.

``"request-level-pinned"``: the routing the paper's artifact simulated for
ServerlessLLM. It differs from :class:`RequestLevelPolicy` in one respect:
a request that can start nowhere at once is bound, at arrival, to one
instance's own FIFO (an instance whose pinned tail is the same model, so they
batch; otherwise the one with the shortest pinned queue, least recently used
on ties) instead of a global queue. When that instance drains, it serves its
FIFO in order -- the head's model, with the head's same-model successors --
even if another instance went idle earlier. That is head-of-line blocking in
its plain form: a request waits for the requests ahead of it on its instance.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from aegaeon_sched.actions import Action
from aegaeon_sched.request import InstanceId, Request
from aegaeon_sched.request_level import RequestLevelPolicy


class PinnedRequestLevelPolicy(RequestLevelPolicy):
    """Policy ``"request-level-pinned"`` (see the module docstring)."""

    def __init__(
        self,
        instances: Sequence[InstanceId],
        *,
        max_batch_size: int = 256,
        capacity_tokens: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(instances, max_batch_size=max_batch_size, capacity_tokens=capacity_tokens)
        self.name = "request-level-pinned"
        self.pinned: dict[InstanceId, deque[Request]] = {i: deque() for i in instances}
        self._pinned_at: dict[str, InstanceId] = {}

    def on_arrival(self, request: Request, now_s: float) -> list[Action]:
        free = {i: s for i, s in self.instances.items() if not self.pinned[i]}
        warm = [i for i, s in free.items() if s.model == request.model and self._fits(s, request)]
        if warm:
            target = min(warm, key=lambda i: len(self.instances[i].running))
            return [self._run(target, request, now_s)]
        idle = [i for i, s in free.items() if not s.running]
        if idle:
            target = min(
                idle,
                key=lambda i: (self.instances[i].model is not None, self.instances[i].last_used_s),
            )
            return [self._run(target, request, now_s)]
        tails = [i for i, q in self.pinned.items() if q and q[-1].model == request.model]
        target = tails[0] if tails else min(
            self.instances, key=lambda i: (len(self.pinned[i]), self.instances[i].last_used_s)
        )  # fmt: skip
        self.pinned[target].append(request)
        self._pinned_at[request.request_id] = target
        return []

    def _pull_queued(self, instance: InstanceId, now_s: float) -> list[Action]:
        state = self.instances[instance]
        queue = self.pinned[instance]
        if not state.running and queue:
            state.model = queue[0].model
        taken: list[Action] = []
        while queue and queue[0].model == state.model and self._fits(state, queue[0]):
            request = queue.popleft()
            del self._pinned_at[request.request_id]
            taken.append(self._run(instance, request, now_s))
        return taken

    def _release(self, request_id: str, now_s: float) -> list[Action]:
        instance = self._pinned_at.pop(request_id, None)
        if instance is not None:  # cancelled while pinned
            queue = self.pinned[instance]
            self.pinned[instance] = deque(r for r in queue if r.request_id != request_id)
            return []
        return super()._release(request_id, now_s)
