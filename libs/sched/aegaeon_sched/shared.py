"""Algorithms 1 and 2 over state that many proxy replicas share.

A replica of the proxy layer keeps no queue of its own. Each instance's
prefill queue and decode work list live in the shared store as plain data
(``*_state`` here, lists of str/int/float that any codec carries), and one
decision is: read the states of the candidate instances, rebuild the very
:class:`~aegaeon_sched.prefill.PrefillDispatcher` /
:class:`~aegaeon_sched.decode.DecodeDispatcher` the single proxy runs, decide,
and hand back the one state the decision changed. The caller does that inside
one store transaction, so a decision commits only on the states it read.

Everything here is pure (no clock, no I/O); ids of new groups and batches come
from the caller (random per decision: two replicas never mint the same one).

A store that loses these states (it restarted empty) gets them back from the
instances: each keeps the same queue as a mirror and merges it with what the
store holds by then (:func:`merge_prefill_states`, :func:`merge_work_lists`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from aegaeon_sched.decode import DecodeDispatcher, DecodeWorkList
from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.prefill import MAX_GPSIZE, PrefillDispatcher, PrefillQueue
from aegaeon_sched.request import InstanceId, NoInstance, Request

State = list[Any]


def request_state(request: Request) -> State:
    """``[id, model, arrival, prompt, max_tokens, oracle, priority, ttft_s, tbt_s, unit]``."""
    return [request.request_id, request.model, request.arrival_s, request.prompt_len,
            request.max_tokens, request.oracle_output_len, request.priority, request.ttft_s,
            request.tbt_s, request.unit]  # fmt: skip


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def request_from_state(state: State) -> Request:
    # the SLO fields and the unit are optional: states written before them hold 6 or 9 items
    rid, model, arrival_s, prompt_len, max_tokens, oracle = state[:6]
    priority, ttft_s, tbt_s, unit = list(state[6:10]) + [1, None, None, ""][len(state[6:10]) :]
    return Request(str(rid), str(model), float(arrival_s), int(prompt_len), int(max_tokens),
                   None if oracle is None else int(oracle), int(priority), _opt_float(ttft_s),
                   _opt_float(tbt_s), str(unit or ""))  # fmt: skip


# ---- prefill queues ------------------------------------------------------------
def prefill_queue_state(queue: PrefillQueue) -> State:
    """``[loaded_model, running_since_s, [[group_id, model, num_added, running, [pending],
    key_s, priority]]]`` (groups in queue order)."""
    groups = [
        [g.group_id, g.model, g.num_added,
         None if g.running is None else request_state(g.running),
         [request_state(r) for r in g.pending], g.key_s, g.priority]
        for g in queue
    ]  # fmt: skip
    since_s = queue.running_since_s if queue.running() is not None else 0.0
    return [queue.loaded_model, since_s, groups]


def group_key_s(state: State, group_id: int) -> float | None:
    """Where group ``group_id`` stands in the queue ``state`` describes (None: absent)."""
    for gid, _model, _added, _running, _pending, *rest in state[2]:
        if int(gid) == group_id and rest:
            return _opt_float(rest[0])
    return None


def prefill_queue_from_state(state: State | None, max_group_size: int = MAX_GPSIZE) -> PrefillQueue:
    """The queue ``state`` describes (``None``: an empty queue)."""
    queue = PrefillQueue(max_group_size)
    if state is None:
        return queue
    loaded_model, running_since_s, groups = state
    for group_id, model, num_added, running, pending, *rest in groups:
        # the key and class are optional (states written before them): the first request's
        key_s = _opt_float(rest[0]) if rest else None
        group = None
        if running is not None:
            req = request_from_state(running)
            group = queue.add(req, int(group_id), key_s=key_s)
            queue.start(req.request_id, float(running_since_s))
        for item in pending:
            group = queue.add(request_from_state(item), int(group_id), key_s=key_s)
        if group is None:
            raise ValueError(f"group {group_id} of model {model!r} holds no request")
        group.num_added = int(num_added)
        if len(rest) > 1:
            group.priority = int(rest[1])
    queue.loaded_model = loaded_model
    return queue


def dispatch_prefill(
    states: Mapping[InstanceId, State | None],
    request: Request,
    latency: LatencyModel,
    now_s: float,
    *,
    new_group_id: int,
    max_group_size: int = MAX_GPSIZE,
) -> tuple[InstanceId, int, State]:
    """Algorithm 1 over the instances of ``states`` (in its order: ties go to the first).

    Returns (instance, group id, that instance's new state). Raises
    :class:`~aegaeon_sched.request.NoInstance` when ``states`` is empty.
    """
    if not states:
        raise NoInstance("no prefill instance is alive")
    dispatcher = PrefillDispatcher(list(states), latency, max_group_size=max_group_size,
                                   next_group_id=new_group_id)  # fmt: skip
    for instance, state in states.items():
        dispatcher.queues[instance] = prefill_queue_from_state(state, max_group_size)
    instance, group_id = dispatcher.dispatch(request, now_s)
    return instance, group_id, prefill_queue_state(dispatcher.queues[instance])


def prefill_done(
    state: State | None, request_id: str, now_s: float, max_group_size: int = MAX_GPSIZE
) -> tuple[State, Request | None]:
    """An instance prefilled ``request_id``: its queue without it (as
    :meth:`PrefillDispatcher.on_done`: the instance's model is now the request's)."""
    queue = prefill_queue_from_state(state, max_group_size)
    if request_id not in queue:
        return prefill_queue_state(queue), None
    running = queue.running()
    if running is None or running.request_id != request_id:
        running = queue.start(request_id, now_s)
    queue.finish(request_id)
    return prefill_queue_state(queue), running


def merge_prefill_states(own: State | None, shared: State | None,
                         max_group_size: int = MAX_GPSIZE) -> State:  # fmt: skip
    """An instance's own queue (``own``: what it holds, in its order; its loaded model
    and running request) with the requests only ``shared`` holds (booked there since
    the store lost the queue, on their way to the instance) added to their groups, a
    group of them the instance does not hold at its key's place. Each group counts
    the larger of its two ``num_added``."""
    queue = prefill_queue_from_state(own, max_group_size)
    if shared is None:
        return prefill_queue_state(queue)
    added: dict[int, int] = {}
    for group_id, _model, num_added, running, pending, *rest in shared[2]:
        key_s = _opt_float(rest[0]) if rest else None
        for item in ([running] if running is not None else []) + list(pending):
            request = request_from_state(item)
            if request.request_id not in queue:
                queue.add(request, int(group_id), key_s=key_s)
        added[int(group_id)] = int(num_added)
    for group in queue:
        group.num_added = max(group.num_added, added.get(group.group_id, 0))
    return prefill_queue_state(queue)


def remove_from_prefill(
    state: State | None, request_id: str, max_group_size: int = MAX_GPSIZE
) -> tuple[State, bool]:
    """Cancel: the queue without ``request_id``; False when it was not there."""
    queue = prefill_queue_from_state(state, max_group_size)
    removed = queue.remove(request_id)
    return prefill_queue_state(queue), removed


# ---- decode work lists -----------------------------------------------------------
def work_list_state(work_list: DecodeWorkList) -> State:
    """``[[batch_id, model, [requests]]]`` in the list's order."""
    return [[b.batch_id, b.model, [request_state(r) for r in b.requests.values()]]
            for b in work_list]  # fmt: skip


def work_list_from_state(state: State | None) -> DecodeWorkList:
    work_list = DecodeWorkList()
    for batch_id, _model, requests in state or ():
        for item in requests:
            work_list.add(request_from_state(item), int(batch_id))
    return work_list


def place_decode(
    states: Mapping[InstanceId, State | None],
    request: Request,
    *,
    new_batch_id: int,
    capacity_tokens: Mapping[InstanceId, Mapping[str, int]],
    decode_shares: Mapping[InstanceId, float] | None = None,
    latency: LatencyModel | None = None,
    tbt_s: float | None = None,
    max_batch_size: int = 256,
    reserved: Collection[InstanceId] = (),
) -> tuple[InstanceId, int, State]:
    """Algorithm 2's placement over the instances of ``states`` (the prefill's
    node's decode-capable instances, decode instances first; ``reserved``: those
    in the prefill role, :attr:`DecodeDispatcher.reserved`). Returns (instance,
    batch id, its new state); :class:`NoInstance` when ``states`` is empty."""
    if not states:
        raise NoInstance("no decode instance is alive on the node")
    dispatcher = _decode_dispatcher(states, capacity_tokens, decode_shares, latency, tbt_s,
                                    max_batch_size, new_batch_id)  # fmt: skip
    dispatcher.reserved.update(i for i in reserved if i in states)
    instance, batch_id = dispatcher.place(request)
    return instance, batch_id, work_list_state(dispatcher.work_lists[instance])


def _decode_dispatcher(
    states: Mapping[InstanceId, State | None],
    capacity_tokens: Mapping[InstanceId, Mapping[str, int]],
    decode_shares: Mapping[InstanceId, float] | None,
    latency: LatencyModel | None,
    tbt_s: float | None,
    max_batch_size: int = 256,
    next_batch_id: int = 0,
) -> DecodeDispatcher:
    dispatcher = DecodeDispatcher(list(states), max_batch_size=max_batch_size, latency=latency,
                                  tbt_s=tbt_s, next_batch_id=next_batch_id)  # fmt: skip
    for instance, state in states.items():
        dispatcher.work_lists[instance] = work_list_from_state(state)
        for model, tokens in capacity_tokens.get(instance, {}).items():
            dispatcher.set_capacity(instance, model, tokens)
        if decode_shares and instance in decode_shares:
            dispatcher.set_decode_share(instance, decode_shares[instance])
    return dispatcher


def decode_demands(
    states: Mapping[InstanceId, State | None],
    *,
    capacity_tokens: Mapping[InstanceId, Mapping[str, int]],
    decode_shares: Mapping[InstanceId, float] | None = None,
    latency: LatencyModel | None = None,
    tbt_s: float | None = None,
) -> dict[InstanceId, float]:
    """Eq. 3's ``S`` of each work list of ``states`` (:meth:`DecodeDispatcher.demand`):
    the role switching's decode demand, as one node's proxy reads it from its own."""
    if not states:
        return {}
    dispatcher = _decode_dispatcher(states, capacity_tokens, decode_shares, latency, tbt_s)
    return {i: dispatcher.demand(i) for i in states}


def prefill_backlog(states: Mapping[InstanceId, State | None], max_group_size: int = MAX_GPSIZE
                    ) -> int:  # fmt: skip
    """Prompt tokens waiting in the prefill queues of ``states`` (not running)."""
    return sum(prefill_queue_from_state(s, max_group_size).pending_tokens()
               for s in states.values())  # fmt: skip


def queued_request_ids(state: State | None, prefill: bool) -> set[str]:
    """The ids a prefill queue state (``prefill``) or a work list state holds."""
    if state is None:
        return set()
    if prefill:
        ids: set[str] = set()
        for _group_id, _model, _num_added, running, pending, *_rest in state[2]:
            ids.update(str(item[0]) for item in pending)
            if running is not None:
                ids.add(str(running[0]))
        return ids
    return {str(item[0]) for _batch_id, _model, requests in state for item in requests}


def merge_work_lists(own: State | None, shared: State | None) -> State:
    """An instance's own work list (``own``) with the requests only ``shared`` holds
    added to their batches (as :func:`merge_prefill_states`)."""
    work_list = work_list_from_state(own)
    for batch_id, _model, requests in shared or ():
        for item in requests:
            request = request_from_state(item)
            if request.request_id not in work_list:
                work_list.add(request, int(batch_id))
    return work_list_state(work_list)


def remove_from_work_list(state: State | None, request_id: str) -> tuple[State, bool]:
    """Finished or cancelled: the work list without ``request_id``."""
    work_list = work_list_from_state(state)
    removed = work_list.remove(request_id)
    return work_list_state(work_list), removed


def remove_requests(state: State | None, request_ids: Collection[str], prefill: bool,
                    max_group_size: int = MAX_GPSIZE) -> tuple[State, bool]:  # fmt: skip
    """A prefill queue state (``prefill``) or a work list state without ``request_ids``;
    False when none of them was there."""
    if prefill:
        queue = prefill_queue_from_state(state, max_group_size)
        removed = [queue.remove(rid) for rid in sorted(request_ids)]
        return prefill_queue_state(queue), any(removed)
    work_list = work_list_from_state(state)
    removed = [work_list.remove(rid) for rid in sorted(request_ids)]
    return work_list_state(work_list), any(removed)
