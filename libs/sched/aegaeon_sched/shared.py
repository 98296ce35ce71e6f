"""Algorithms 1 and 2 over queues that many proxy replicas share.

A replica of the proxy layer keeps no queue of its own. Each instance's
prefill queue and decode work list live in the shared store as msgpack of the
objects themselves: :class:`~aegaeon_sched.prefill.PrefillQueue` and
:class:`~aegaeon_sched.decode.DecodeWorkList` are msgspec structs, so
:func:`prefill_queue_of` / :func:`work_list_of` decode the store's bytes
straight into the queues the single proxy runs (msgpack-encoding a queue
writes it back). One decision is: decode the candidate instances' queues, run
the very :class:`~aegaeon_sched.prefill.PrefillDispatcher` /
:class:`~aegaeon_sched.decode.DecodeDispatcher` the single proxy runs over
them, decide, and encode the one queue the decision changed. The caller does
that inside one store transaction, so a decision commits only on the queues it
read; the functions here change the queues they are given (decode them afresh
for each run of a transaction).

Everything here is pure (no clock, no I/O); ids of new groups and batches come
from the caller (random per decision: two replicas never mint the same one).

A store that loses these queues (it restarted empty) gets them back from the
instances: each keeps the same queue as a mirror and merges it with what the
store holds by then (:func:`merge_prefill_queues`, :func:`merge_work_lists`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import msgspec

from aegaeon_sched.decode import DecodeDispatcher, DecodeWorkList
from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.prefill import MAX_GPSIZE, PrefillDispatcher, PrefillQueue
from aegaeon_sched.request import InstanceId, NoInstance, Request

Queue = PrefillQueue | DecodeWorkList

_prefill_decoder = msgspec.msgpack.Decoder(PrefillQueue)
_work_list_decoder = msgspec.msgpack.Decoder(DecodeWorkList)


def prefill_queue_of(raw: bytes | None, max_group_size: int = MAX_GPSIZE) -> PrefillQueue:
    """The queue ``raw`` holds, with the group size it was made with (``None``, an
    absent key: an empty one of ``max_group_size``). Raises ``msgspec.DecodeError``
    / ``ValidationError``."""
    if raw is None:
        return PrefillQueue(max_group_size=max_group_size)
    return _prefill_decoder.decode(raw)


def work_list_of(raw: bytes | None) -> DecodeWorkList:
    """The work list ``raw`` holds (``None``: an empty one)."""
    return DecodeWorkList() if raw is None else _work_list_decoder.decode(raw)


def queue_of(raw: bytes | None, prefill: bool, max_group_size: int = MAX_GPSIZE) -> Queue:
    """A prefill queue (``prefill``) or a work list from ``raw``."""
    return prefill_queue_of(raw, max_group_size) if prefill else work_list_of(raw)


# ---- prefill queues ------------------------------------------------------------
def dispatch_prefill(
    queues: Mapping[InstanceId, PrefillQueue],
    request: Request,
    latency: LatencyModel,
    now_s: float,
    *,
    new_group_id: int,
) -> tuple[InstanceId, int, PrefillQueue]:
    """Algorithm 1 over the instances of ``queues`` (in its order: ties go to the first).

    Returns (instance, group id, that instance's queue: the one the decision changed). Raises
    :class:`~aegaeon_sched.request.NoInstance` when ``queues`` is empty.
    """
    if not queues:
        raise NoInstance("no prefill instance is alive")
    dispatcher = PrefillDispatcher(list(queues), latency, next_group_id=new_group_id)
    dispatcher.queues.update(queues)
    instance, group_id = dispatcher.dispatch(request, now_s)
    return instance, group_id, queues[instance]


def merge_prefill_queues(own: PrefillQueue, shared: PrefillQueue) -> PrefillQueue:
    """An instance's own queue (``own``: what it holds, in its order; its loaded model
    and running request) with the requests only ``shared`` holds (booked there since
    the store lost the queue, on their way to the instance) added to their groups, a
    group of them the instance does not hold at its key's place. Each group counts
    the larger of its two ``num_added``. Changes and returns ``own``."""
    added: dict[int, int] = {}
    for group in shared:
        for request in ([group.running] if group.running is not None else []) + group.pending:
            if request.request_id not in own:
                own.add(request, group.group_id, key_s=group.key_s)
        added[group.group_id] = group.num_added
    for group in own:
        group.num_added = max(group.num_added, added.get(group.group_id, 0))
    return own


def prefill_backlog(queues: Collection[PrefillQueue]) -> int:
    """Prompt tokens waiting in ``queues`` (not running)."""
    return sum(q.pending_tokens() for q in queues)


# ---- decode work lists -----------------------------------------------------------
def place_decode(
    work_lists: Mapping[InstanceId, DecodeWorkList],
    request: Request,
    *,
    new_batch_id: int,
    capacity_tokens: Mapping[InstanceId, Mapping[str, int]],
    decode_shares: Mapping[InstanceId, float] | None = None,
    latency: LatencyModel | None = None,
    tbt_s: float | None = None,
    max_batch_size: int = 256,
    reserved: Collection[InstanceId] = (),
) -> tuple[InstanceId, int, DecodeWorkList]:
    """Algorithm 2's placement over the instances of ``work_lists`` (the prefill's
    node's decode-capable instances, decode instances first; ``reserved``: those
    in the prefill role, :attr:`DecodeDispatcher.reserved`). Returns (instance,
    batch id, its work list: the one the decision changed); :class:`NoInstance`
    when ``work_lists`` is empty."""
    if not work_lists:
        raise NoInstance("no decode instance is alive on the node")
    dispatcher = _decode_dispatcher(work_lists, capacity_tokens, decode_shares, latency, tbt_s,
                                    max_batch_size, new_batch_id)  # fmt: skip
    dispatcher.reserved.update(i for i in reserved if i in work_lists)
    instance, batch_id = dispatcher.place(request)
    return instance, batch_id, work_lists[instance]


def _decode_dispatcher(
    work_lists: Mapping[InstanceId, DecodeWorkList],
    capacity_tokens: Mapping[InstanceId, Mapping[str, int]],
    decode_shares: Mapping[InstanceId, float] | None,
    latency: LatencyModel | None,
    tbt_s: float | None,
    max_batch_size: int = 256,
    next_batch_id: int = 0,
) -> DecodeDispatcher:
    dispatcher = DecodeDispatcher(list(work_lists), max_batch_size=max_batch_size,
                                  latency=latency, tbt_s=tbt_s,
                                  next_batch_id=next_batch_id)  # fmt: skip
    dispatcher.work_lists.update(work_lists)
    for instance in work_lists:
        for model, tokens in capacity_tokens.get(instance, {}).items():
            dispatcher.set_capacity(instance, model, tokens)
        if decode_shares and instance in decode_shares:
            dispatcher.set_decode_share(instance, decode_shares[instance])
    return dispatcher


def decode_demands(
    work_lists: Mapping[InstanceId, DecodeWorkList],
    *,
    capacity_tokens: Mapping[InstanceId, Mapping[str, int]],
    decode_shares: Mapping[InstanceId, float] | None = None,
    latency: LatencyModel | None = None,
    tbt_s: float | None = None,
) -> dict[InstanceId, float]:
    """Eq. 3's ``S`` of each of ``work_lists`` (:meth:`DecodeDispatcher.demand`):
    the role switching's decode demand, as one node's proxy reads it from its own."""
    if not work_lists:
        return {}
    dispatcher = _decode_dispatcher(work_lists, capacity_tokens, decode_shares, latency, tbt_s)
    return {i: dispatcher.demand(i) for i in work_lists}


def merge_work_lists(own: DecodeWorkList, shared: DecodeWorkList) -> DecodeWorkList:
    """An instance's own work list (``own``) with the requests only ``shared`` holds
    added to their batches (as :func:`merge_prefill_queues`). Changes and returns ``own``."""
    for batch in shared:
        for request in batch.requests.values():
            if request.request_id not in own:
                own.add(request, batch.batch_id)
    return own


# ---- either --------------------------------------------------------------------
def queued_request_ids(queue: Queue) -> set[str]:
    """The ids a prefill queue or a work list holds (running ones included)."""
    if isinstance(queue, DecodeWorkList):
        return {rid for batch in queue for rid in batch.requests}
    return {r.request_id for g in queue
            for r in ([g.running] if g.running is not None else []) + g.pending}  # fmt: skip


def remove_requests(queue: Queue, request_ids: Collection[str]) -> bool:
    """Take ``request_ids`` out of ``queue`` (finished, cancelled); False when none
    of them was there."""
    return any([queue.remove(rid) for rid in sorted(request_ids)])
