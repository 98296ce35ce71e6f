"""Aegaeon: disaggregated token-level scheduling (Algorithms 1 and 2).

Arrivals go to a prefill group (Alg. 1); a finished prefill is placed on a
decode batch (Alg. 2, line 2). What runs when on an instance is decided there,
on its mirror of the queue (prefill: :meth:`PrefillQueue.peek`; decode:
:class:`~aegaeon_sched.quota.RoundRobinPlanner` over its work list).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aegaeon_sched.actions import (
    Action,
    Cancel,
    EnqueuePrefill,
    PlaceDecode,
    PolicyBase,
    RoleLoad,
)
from aegaeon_sched.decode import DecodeDispatcher
from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.prefill import MAX_GPSIZE, PrefillDispatcher, PrefillJob
from aegaeon_sched.request import InstanceId, NoInstance, Request


class AegaeonPolicy(PolicyBase):
    """Policy ``"aegaeon"`` (see :mod:`aegaeon_sched.actions` for the contract)."""

    name = "aegaeon"

    def __init__(
        self,
        prefill_instances: Sequence[InstanceId],
        decode_instances: Sequence[InstanceId],
        latency: LatencyModel,
        *,
        max_group_size: int = MAX_GPSIZE,
        max_batch_size: int = 256,
        default_capacity_tokens: int | None = None,
        decode_tbt_s: float | None = None,
        default_ttft_s: float = 0.0,
        standby: Sequence[InstanceId] = (),
        role_switching: bool = False,
    ) -> None:
        """``decode_tbt_s``: the decode instances' TBT target; with it, decode
        placement weighs instances by their work lists' demand (see
        :class:`DecodeDispatcher`), without it by their batch counts.
        ``default_ttft_s``: the TTFT of a request that carries none (the order
        of prefill groups, :mod:`aegaeon_sched.priority`). ``standby``: prefill
        instances that start in the decode role (:meth:`set_role`).
        ``role_switching``: roles move (:mod:`aegaeon_sched.roles`), and an
        instance in the prefill role takes new decode requests only when no
        instance in the decode role is open (:attr:`DecodeDispatcher.reserved`);
        without it a prefill instance that also decodes (hybrid) is placed on by
        its decode share alone."""
        self.latency = latency
        self.prefill = PrefillDispatcher(prefill_instances, latency, max_group_size=max_group_size,
                                         default_ttft_s=default_ttft_s)  # fmt: skip
        self.prefill.standby.update(standby)
        self.decode = DecodeDispatcher(
            decode_instances,
            max_batch_size=max_batch_size,
            default_capacity_tokens=default_capacity_tokens,
            latency=latency,
            tbt_s=decode_tbt_s,
        )
        self.role_switching = role_switching
        if role_switching:
            self.decode.reserved.update(
                i for i in decode_instances if self.prefill_role(i)
            )
        # Work no instance may take now (every one of its kind is paused), in
        # arrival order; dispatched when an instance resumes.
        self.held_arrivals: dict[str, Request] = {}
        self.held_placements: dict[str, Request] = {}

    # ---- instances leaving and rejoining (drain, restart) ---------------
    def pause(self, instance: InstanceId) -> list[Action]:
        """``instance`` takes no new work (it drains what it holds)."""
        if instance in self.prefill.queues:
            self.prefill.paused.add(instance)
        if instance in self.decode.work_lists:
            self.decode.paused.add(instance)
        return []

    def resume(self, instance: InstanceId, now_s: float) -> list[Action]:
        """``instance`` takes work again; held work is dispatched now."""
        self.prefill.paused.discard(instance)
        self.decode.paused.discard(instance)
        actions: list[Action] = []
        if self.prefill.can_dispatch():
            held, self.held_arrivals = self.held_arrivals, {}
            for request in held.values():
                actions += self.on_arrival(request, now_s)
        if self.decode.can_place():
            placements, self.held_placements = self.held_placements, {}
            for request in placements.values():
                actions += self._place(request)
        return actions

    def held_counts(self) -> tuple[int, int]:
        return len(self.held_arrivals), len(self.held_placements)

    def learn(self, instance: InstanceId, capacity_tokens: Mapping[str, int],
              latency: LatencyModel | None) -> None:  # fmt: skip
        if latency is not None:
            for name, spec in latency.specs.items():
                self.latency.specs.setdefault(name, spec)
        if instance in self.decode.work_lists:
            for model, tokens in capacity_tokens.items():
                self.decode.set_capacity(instance, model, tokens)

    def set_decode_share(self, instance: InstanceId, share: float) -> None:
        self.decode.set_decode_share(instance, share)

    # ---- roles (aegaeon_sched.roles) -----------------------------------
    def role_load(self) -> RoleLoad | None:
        backlog = sum(q.pending_tokens() for q in self.prefill.queues.values())
        backlog += sum(r.prompt_len for r in self.held_arrivals.values())
        demand = {i: self.decode.demand(i) for i in self.decode.work_lists}
        return RoleLoad(backlog, demand, self.latency)

    def set_role(self, instance: InstanceId, role: str, now_s: float) -> list[Action]:
        """``instance`` takes prefill work (``"prefill"``) or not (``"decode"``).

        Leaving the prefill role drains safely: its queued groups still run, no
        new group goes there; its decode batches are untouched either way.
        Arrivals held while no instance could prefill go out on a return. With
        ``role_switching``, an instance in the prefill role gets no new decode
        requests while an instance in the decode role is open (each of its
        prefills and their model switches would stall them); the ones it holds
        run on, and it takes new ones again on its return.
        """
        if instance not in self.prefill.queues:
            raise ValueError(f"{instance!r} is not a prefill-capable instance")
        if role == "decode":
            self.prefill.standby.add(instance)
            self.decode.reserved.discard(instance)
            return []
        self.prefill.standby.discard(instance)
        if self.role_switching and instance in self.decode.work_lists:
            self.decode.reserved.add(instance)
        if not self.prefill.can_dispatch():
            return []
        held, self.held_arrivals = self.held_arrivals, {}
        actions: list[Action] = []
        for request in held.values():
            actions += self.on_arrival(request, now_s)
        return actions

    def prefill_role(self, instance: InstanceId) -> bool:
        return instance in self.prefill.queues and instance not in self.prefill.standby

    def _place(self, request: Request) -> list[Action]:
        try:
            decode_instance, batch_id = self.decode.place(request)
        except NoInstance:
            self.held_placements[request.request_id] = request
            return []
        return [PlaceDecode(decode_instance, batch_id, request)]

    # ---- events --------------------------------------------------------
    def on_arrival(self, request: Request, now_s: float) -> list[Action]:
        try:
            instance, group_id = self.prefill.dispatch(request, now_s)
        except NoInstance:
            self.held_arrivals[request.request_id] = request
            return []
        key_s = self.prefill.queues[instance].group_key_s(group_id)
        return [EnqueuePrefill(instance, group_id, request, key_s)]

    def on_prefill_started(
        self, instance: InstanceId, request_id: str, now_s: float
    ) -> list[Action]:
        self.prefill.on_started(instance, request_id, now_s)
        return []

    def on_prefill_done(
        self, instance: InstanceId, request_id: str, measured_s: float, now_s: float
    ) -> list[Action]:
        request = self.prefill.on_done(instance, request_id, now_s)
        if request is None:
            return []  # cancelled meanwhile
        if measured_s > 0:
            self.latency.observe_prefill(request.switch_unit, [request.prompt_len], measured_s)
        if request.max_tokens <= 1:
            return []  # the prefill's token was the last one
        return self._place(request)

    def on_request_finished(self, request_id: str, now_s: float) -> list[Action]:
        self.held_arrivals.pop(request_id, None)
        self.held_placements.pop(request_id, None)
        self.decode.remove(request_id)
        self.prefill.cancel(request_id)  # finished during prefill (e.g. a stop token)
        return []

    def on_request_cancelled(self, request_id: str, now_s: float) -> list[Action]:
        self.held_arrivals.pop(request_id, None)
        self.held_placements.pop(request_id, None)
        actions: list[Action] = []
        prefill_instance = self.prefill.cancel(request_id)
        if prefill_instance is not None:
            actions.append(Cancel(prefill_instance, request_id))
        decode_instance = self.decode.remove(request_id)
        if decode_instance is not None:
            actions.append(Cancel(decode_instance, request_id))
        return actions

    # ---- helpers for an instance loop sharing this process (simulator) --
    def next_prefill(self, instance: InstanceId, now_s: float) -> PrefillJob | None:
        """Take the next prefill job of ``instance`` from the global view."""
        return self.prefill.next_job(instance, now_s)
