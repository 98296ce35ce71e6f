"""Decode placement (Algorithm 2, line 2) and the per-instance work list.

:class:`DecodeWorkList` is one decode instance's list of per-model batches.
Like :class:`~aegaeon_sched.prefill.PrefillQueue` it lives on both sides and is
its own stored form: the proxy's :class:`DecodeDispatcher` keeps one per instance,
and each instance mirrors it by applying the same ``add(request, batch_id)``
calls (an unknown batch id opens a batch at the tail) and removals.

Room: a batch of model M on instance I may take a request if it has fewer
than ``max_batch_size`` requests and its reserved KV tokens plus the
request's ``prompt_len + max_tokens`` fit in the instance-reported capacity
for M's KV shape. Only the batch taking its turn is resident on the device
(the others are swapped to the host cache), so capacity is per batch.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView, Sequence

import msgspec

from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.request import InstanceId, NoInstance, Request

JOIN_LOAD_LIMIT = 1.0


class DecodeBatch(msgspec.Struct, array_like=True):
    """Requests decoded together: of ``model``, and of its LoRA adapters (its unit)."""

    batch_id: int
    model: str
    requests: dict[str, Request] = msgspec.field(default_factory=dict)
    reserved_tokens: int = 0
    mean_context_tokens: int = 0  # sum over requests of prompt + max_tokens / 2

    @staticmethod
    def mean_context(request: Request) -> int:
        return request.prompt_len + request.max_tokens // 2

    @property
    def tbt_s(self) -> float | None:
        """The tightest TBT target of its requests (SLO classes, :mod:`aegaeon_sched.priority`);
        ``None`` when none carries one (the deployment's target)."""
        targets = [r.tbt_s for r in self.requests.values() if r.tbt_s is not None]
        return min(targets) if targets else None

    def __len__(self) -> int:
        return len(self.requests)


class DecodeWorkList(msgspec.Struct, array_like=True, dict=True):
    """One decode instance's ordered batches (see the module docstring)."""

    batches: list[DecodeBatch] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        self._by_id: dict[int, DecodeBatch] = {b.batch_id: b for b in self.batches}
        self._batch_of = {rid: b for b in self.batches for rid in b.requests}

    def __len__(self) -> int:
        """Number of batches: the load measure of Algorithm 2."""
        return len(self.batches)

    def __iter__(self) -> Iterator[DecodeBatch]:
        return iter(self.batches)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._batch_of

    @property
    def num_requests(self) -> int:
        return len(self._batch_of)

    @property
    def batch_ids(self) -> KeysView[int]:  # a live view
        return self._by_id.keys()

    def batch(self, batch_id: int) -> DecodeBatch | None:
        return self._by_id.get(batch_id)

    def add(self, request: Request, batch_id: int) -> DecodeBatch:
        """Add to batch ``batch_id``; an unknown id opens a batch at the tail."""
        if request.request_id in self._batch_of:
            raise ValueError(f"request {request.request_id!r} is already placed")
        batch = self._by_id.get(batch_id)
        if batch is None:
            batch = DecodeBatch(batch_id, request.switch_unit)
            self.batches.append(batch)
            self._by_id[batch_id] = batch
        elif batch.model != (unit := request.switch_unit):
            raise ValueError(f"batch {batch_id} holds {batch.model!r}, not {unit!r}")
        batch.requests[request.request_id] = request
        batch.reserved_tokens += request.kv_tokens
        batch.mean_context_tokens += DecodeBatch.mean_context(request)
        self._batch_of[request.request_id] = batch
        return batch

    def remove(self, request_id: str) -> bool:
        """Finish or cancel; an emptied batch leaves the list at once."""
        batch = self._batch_of.pop(request_id, None)
        if batch is None:
            return False
        request = batch.requests.pop(request_id)
        batch.reserved_tokens -= request.kv_tokens
        batch.mean_context_tokens -= DecodeBatch.mean_context(request)
        if not batch.requests:
            self.batches.remove(batch)
            del self._by_id[batch.batch_id]
        return True

    def group_by_model(self) -> list[DecodeBatch]:
        """Reorder in place so same-model batches are adjacent (Alg. 2, line 6); stable:
        models keep the order of their first batch, batches of one model theirs."""
        order: dict[str, list[DecodeBatch]] = {}
        for batch in self.batches:
            order.setdefault(batch.model, []).append(batch)
        self.batches = [b for batches in order.values() for b in batches]
        return list(self.batches)


class DecodeDispatcher:
    """The proxy's view of every decode instance's work list (Alg. 2, line 2).

    With ``latency`` and ``tbt_s`` (as :class:`~aegaeon_sched.AegaeonPolicy`
    builds it), an instance's load is its decode demand: the share of its time
    its batches need to step every ``tbt_s`` (the sum of their Eq. 6 step
    times over the TBT target, Eq. 3's ``S``; a batch whose requests carry a
    tighter target, :attr:`DecodeBatch.tbt_s`, over that), per unit of decode share.
    Without them every batch counts one (the paper's count of batches).
    Switches are left out of the demand: prefetching hides most of them, and
    counting them (Eq. 3's round term) made instances that kept up look
    overloaded (simulated with an earlier, eager version of :meth:`place`:
    90% against 98% attainment, 40 models on 4 decode GPUs).
    """

    def __init__(
        self,
        instances: Sequence[InstanceId],
        *,
        max_batch_size: int = 256,
        default_capacity_tokens: int | None = None,
        latency: LatencyModel | None = None,
        tbt_s: float | None = None,
        next_batch_id: int = 0,
    ) -> None:
        """``next_batch_id``: the id the next new batch gets (then +1 each)."""
        if not instances:
            raise ValueError("Algorithm 2 needs at least one decode instance")
        self.max_batch_size = max_batch_size
        self.default_capacity_tokens = default_capacity_tokens
        self.work_lists: dict[InstanceId, DecodeWorkList] = {i: DecodeWorkList() for i in instances}
        if tbt_s is not None and tbt_s <= 0:
            raise ValueError("tbt_s must be positive")
        self.latency = latency if tbt_s is not None else None
        self.tbt_s = tbt_s or 0.0
        self._capacity: dict[tuple[InstanceId, str], int] = {}
        self._share: dict[InstanceId, float] = {}
        self._instance_of: dict[str, InstanceId] = {}
        self._next_batch_id = next_batch_id
        # Instances that take no new requests (draining; restarting): their
        # batches still run, nothing joins them.
        self.paused: set[InstanceId] = set()
        # Role switching: instances in the prefill role (each prefill stalls their
        # batches), placed on only when no other keeps up (:meth:`place`).
        self.reserved: set[InstanceId] = set()

    def can_place(self) -> bool:
        """Some instance takes new requests."""
        return any(i not in self.paused for i in self.work_lists)

    def set_decode_share(self, instance: InstanceId, share: float) -> None:
        """The share of ``instance``'s time left for decoding, in (0, 1] (default 1).

        Past the paper: a hybrid instance (a prefill instance that decodes when
        idle) reports ``1 - its prefill busy fraction``; loads are per unit of
        decode share, so a busy prefill instance takes decode work only when
        the decode instances hold proportionally more.
        """
        self._share[instance] = min(1.0, max(share, 1e-3))

    def set_capacity(self, instance: InstanceId, model: str, kv_tokens: int) -> None:
        """Instance-reported device KV capacity, in tokens of ``model``'s KV shape."""
        self._capacity[(instance, model)] = kv_tokens

    def capacity_tokens(self, instance: InstanceId, model: str) -> int | None:
        """``None`` means unbounded (nothing reported and no default)."""
        return self._capacity.get((instance, model), self.default_capacity_tokens)

    def instance_of(self, request_id: str) -> InstanceId | None:
        return self._instance_of.get(request_id)

    def has_room(self, instance: InstanceId, batch: DecodeBatch, request: Request) -> bool:
        if len(batch) >= self.max_batch_size:
            return False
        cap = self.capacity_tokens(instance, batch.model)
        return cap is None or batch.reserved_tokens + request.kv_tokens <= cap

    def load(
        self, instance: InstanceId, request: Request | None = None, join: int | None = None
    ) -> float:
        """``instance``'s load per unit of decode share, with ``request`` added to
        batch ``join`` (or to a new batch when ``join`` is ``None``)."""
        share = self._share.get(instance, 1.0)
        work_list = self.work_lists[instance]
        if self.latency is None:
            return (len(work_list) + (request is not None and join is None)) / share
        lat = self.latency
        demand = 0.0
        for b in work_list:
            n, ctx, tbt = len(b), b.mean_context_tokens, b.tbt_s or self.tbt_s
            if request is not None and b.batch_id == join:
                n, ctx = n + 1, ctx + DecodeBatch.mean_context(request)
                tbt = min(tbt, request.tbt_s or tbt)
            demand += lat.decode_step_s(b.model, n, ctx) / tbt
        if request is not None and join is None:
            step_s = lat.decode_step_s(request.switch_unit, 1, DecodeBatch.mean_context(request))
            demand += step_s / (request.tbt_s or self.tbt_s)
        return demand / share

    def demand(self, instance: InstanceId) -> float:
        """The share of ``instance``'s time its decode work needs (Eq. 3's ``S``; the
        number of batches when loads are counts)."""
        return self.load(instance) * self._share.get(instance, 1.0)

    def place(self, request: Request) -> tuple[InstanceId, int]:
        """Choose (instance, batch id) for a prefilled request and record it.

        Alg. 2, line 2: a batch of the request's model with room takes it;
        otherwise a new batch opens on the least loaded instance (first on
        ties). A request larger than a whole batch's capacity still gets a
        batch of its own: refusing it here would only move the failure.

        Past the paper, when loads are demands (``latency`` given): the least
        loaded batch of the model takes the request while its instance keeps
        up (load <= :data:`JOIN_LOAD_LIMIT`); past that a new batch of the
        model opens on the least loaded instance if that one keeps up with it.
        A model with a steady stream of requests never empties its batch, so
        the paper's rule binds it to one instance for good, however loaded
        (live: three of six models starved on a busy hybrid instance while the
        decode instance idled). When no instance would keep up, the request
        joins: a new batch would only add a switch to every round (simulated,
        Fig. 11a at 96 models: 78% attainment against 98% when moving to the
        least loaded instance regardless).

        Paused instances are skipped. Reserved ones (:attr:`reserved`) are
        left out while another instance is open and, when loads are demands,
        keeps up with the request; only when none does is the choice made
        over every open instance. Raises :class:`NoInstance` when every
        instance is paused.
        """
        if not self.can_place():
            raise NoInstance("every decode instance is paused")
        open_lists = [i for i in self.work_lists if i not in self.paused]
        preferred = [i for i in open_lists if i not in self.reserved]
        choice = self._choose(request, preferred or open_lists)
        if preferred and len(preferred) < len(open_lists) and choice[0] > self._limit():
            choice = min(choice, self._choose(request, open_lists), key=lambda c: c[0])
        _, instance, batch_id = choice
        if batch_id < 0:
            batch_id = self._next_batch_id
            self._next_batch_id += 1
        self.work_lists[instance].add(request, batch_id)
        self._instance_of[request.request_id] = instance
        return instance, batch_id

    def _limit(self) -> float:
        return float("inf") if self.latency is None else JOIN_LOAD_LIMIT

    def _choose(self, request: Request, instances: Sequence[InstanceId]) -> tuple[float, str, int]:
        """(load, instance, batch id or -1: new) by :meth:`place`'s rules over ``instances``."""
        rooms = ((i, b.batch_id) for i in instances for b in self.work_lists[i]
                 if b.model == request.switch_unit and self.has_room(i, b, request))  # fmt: skip
        choice: tuple[float, InstanceId, int] | None
        if self.latency is None:  # the paper's rule: the first batch found, always
            first = next(rooms, None)
            choice = (0.0, *first) if first is not None else None
        else:
            joins = [(self.load(i, request, bid), i, bid) for i, bid in rooms]
            choice = min(joins, key=lambda j: j[0], default=None)
        limit = self._limit()
        if choice is None or choice[0] > limit:
            # min keeps the first of equals: the first instance.
            fresh = min(((self.load(i, request), i, -1) for i in instances),
                        key=lambda j: j[0])  # fmt: skip
            if choice is None or fresh[0] <= limit:
                choice = fresh
        return choice

    def remove(self, request_id: str) -> InstanceId | None:
        """A request finished or was cancelled; the instance it was on."""
        instance = self._instance_of.pop(request_id, None)
        if instance is not None:
            self.work_lists[instance].remove(request_id)
        return instance
