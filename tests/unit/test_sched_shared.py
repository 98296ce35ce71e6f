"""Algorithms 1 and 2 over queues that go through the store make the single proxy's
decisions, step for step: a queue decoded from its stored bytes is the live one."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from aegaeon_sched import (
    DecodeDispatcher,
    DecodeWorkList,
    LatencyModel,
    NoInstance,
    PrefillDispatcher,
    PrefillQueue,
    Request,
)
from aegaeon_sched.shared import (
    dispatch_prefill,
    merge_prefill_queues,
    merge_work_lists,
    place_decode,
    prefill_queue_of,
    queued_request_ids,
    remove_requests,
    work_list_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_support import tiny_latency


def _latency() -> LatencyModel:
    return tiny_latency("abcd", decode_s=0.0025, decode_per_seq_s=0.001, switch_s=0.5,
                        switch_beta=0.625)  # fmt: skip


def _stored(queue: PrefillQueue) -> bytes:
    return msgspec.msgpack.encode(queue)


# an arrival (model, prompt, SLO class, own TTFT or None), an end (which queued
# request, done or cancelled) or a start (which instance runs its next request)
_arrival = st.tuples(st.sampled_from("abcd"), st.integers(1, 400), st.integers(0, 2),
                     st.one_of(st.none(), st.sampled_from([0.5, 2.0])))  # fmt: skip
_end = st.tuples(st.integers(0, 10**6), st.booleans())
_start = st.integers(0, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(_arrival, _end, _start), min_size=1, max_size=120))
def test_prefill_through_the_store_equals_the_live_dispatcher(ops: list[Any]) -> None:
    """Arrivals, starts, completions and cancels: the live PrefillDispatcher and queues that
    go through their stored bytes at every step choose the same instance and group
    every time (group ids minted alike), and each reloaded queue equals the live one
    (its groups, order, running request, loaded model and load)."""
    lat = _latency()
    names = ["n0/prefill-0", "n1/prefill-0", "n2/prefill-0"]
    live = PrefillDispatcher(names, lat, max_group_size=4)
    stored: dict[str, bytes | None] = dict.fromkeys(names)
    queued: list[tuple[str, str]] = []
    next_id = 0
    for step, op in enumerate(ops):
        now = step * 0.01
        if isinstance(op, int):
            instance = names[op]
            job = live.next_job(instance, now)
            queue = prefill_queue_of(stored[instance], 4)
            head = queue.peek()
            assert (head and head[1]) == (job and job.request)
            if head is not None:
                queue.start(head[1].request_id, now)
            stored[instance] = _stored(queue)
        elif len(op) == 4 or not queued:
            model, prompt, cls, ttft = op if len(op) == 4 else ("a", 8, 1, None)
            req = Request(f"r{step}", model, now, prompt, 16, priority=cls, ttft_s=ttft)
            want = live.dispatch(req, now)
            queues = {n: prefill_queue_of(raw, 4) for n, raw in stored.items()}
            instance, group, queue = dispatch_prefill(queues, req, lat, now,
                                                      new_group_id=next_id)  # fmt: skip
            next_id = max(next_id, group + 1)
            stored[instance] = _stored(queue)
            assert (instance, group) == want
            queued.append((instance, req.request_id))
        else:
            instance, rid = queued.pop(op[0] % len(queued))
            queue = prefill_queue_of(stored[instance], 4)
            if op[1]:
                assert queue.done(rid, now) == live.on_done(instance, rid, now)
            else:  # (a start after a lost finish took the one that ran out already)
                held = rid in live.queues[instance]
                assert live.cancel(rid) == instance
                assert remove_requests(queue, {rid}) is held
            stored[instance] = _stored(queue)
        for name in names:  # the whole queue round-trips, loads included
            queue = prefill_queue_of(stored[name], 4)
            assert queue == live.queues[name] and len(queue) == len(live.queues[name])
            assert queue.running() == live.queues[name].running()
            assert queue.load_s(lat, now) == pytest.approx(live.queues[name].load_s(lat, now))


def test_decode_placement_through_the_store_equals_the_live_dispatcher() -> None:
    rng = random.Random(3)
    lat = _latency()
    names = ["n0/decode-0", "n0/prefill-0"]
    caps = {"n0/decode-0": dict.fromkeys("abcd", 2000), "n0/prefill-0": dict.fromkeys("abcd", 900)}
    live = DecodeDispatcher(names, latency=lat, tbt_s=0.05, max_batch_size=8,
                            next_batch_id=100)  # fmt: skip
    for name, by_model in caps.items():
        for model, tokens in by_model.items():
            live.set_capacity(name, model, tokens)
    live.set_decode_share("n0/prefill-0", 0.4)
    stored: dict[str, bytes | None] = dict.fromkeys(names)
    placed: list[tuple[str, str]] = []
    next_id = 100
    for step in range(150):
        if rng.random() < 0.65 or not placed:
            req = Request(f"r{step}", rng.choice("abcd"), 0.0, rng.randint(10, 300), 64)
            want = live.place(req)
            work_lists = {n: work_list_of(raw) for n, raw in stored.items()}
            instance, batch, work_list = place_decode(
                work_lists, req, new_batch_id=next_id, capacity_tokens=caps,
                decode_shares={"n0/prefill-0": 0.4}, latency=lat, tbt_s=0.05, max_batch_size=8,
            )  # fmt: skip
            next_id = max(next_id, batch + 1)
            stored[instance] = msgspec.msgpack.encode(work_list)
            assert (instance, batch) == want
            placed.append((instance, req.request_id))
        else:
            instance, rid = placed.pop(rng.randrange(len(placed)))
            assert live.remove(rid) == instance
            work_list = work_list_of(stored[instance])
            assert remove_requests(work_list, {rid})
            stored[instance] = msgspec.msgpack.encode(work_list)
        for name in names:
            assert work_list_of(stored[name]) == live.work_lists[name]


def test_no_candidate_instance_is_no_instance() -> None:
    with pytest.raises(NoInstance):
        dispatch_prefill({}, Request("r", "a", 0.0, 5, 5), _latency(), 0.0, new_group_id=1)
    with pytest.raises(NoInstance):
        place_decode({}, Request("r", "a", 0.0, 5, 5), new_batch_id=1, capacity_tokens={})


def test_a_malformed_queue_is_an_error() -> None:
    with pytest.raises(msgspec.ValidationError, match="holds no request"):
        prefill_queue_of(msgspec.msgpack.encode([None, 0.0, [[1, "a", 1, None, []]]]))
    with pytest.raises(msgspec.ValidationError):
        work_list_of(msgspec.msgpack.encode([[["not an id", "a", {}]]]))


def test_an_instance_merges_its_own_queues_with_what_the_store_booked_since_a_loss() -> None:
    """The store lost an instance's queue and the replicas booked two requests on the
    empty one since (on their way to the instance): the merge keeps the instance's
    groups, order, loaded model and running request, and adds those two where the
    store put them (one to a group the instance holds, one in a new group)."""
    own = PrefillQueue(max_group_size=4)
    for rid, group in (("a1", 1), ("a2", 1), ("b1", 2)):
        own.add(Request(rid, rid[0], 0.0, 10, 4), group)
    own.start("a1", 5.0)
    own_raw = _stored(own)
    booked = PrefillQueue(max_group_size=4)
    booked.add(Request("a3", "a", 1.0, 10, 4), 1)  # joined the open group of a
    booked.add(Request("c1", "c", 1.0, 10, 4), 3)
    merged = merge_prefill_queues(own, prefill_queue_of(_stored(booked)))
    assert merged.loaded_model == "a" and merged.running() is not None
    assert [(g.group_id, [r.request_id for r in g.pending]) for g in merged] == [
        (1, ["a2", "a3"]), (2, ["b1"]), (3, ["c1"])]
    assert [g.num_added for g in merged] == [3, 1, 1]
    assert prefill_queue_of(_stored(merged)) == merged
    # (nothing booked since)
    assert merge_prefill_queues(prefill_queue_of(own_raw), prefill_queue_of(None)) == \
        prefill_queue_of(own_raw)  # fmt: skip
    # a decode work list likewise
    merged_list = merge_work_lists(_work([("y1", 8), ("y2", 8)]),
                                   _work([("y2", 8), ("x1", 7)]))  # fmt: skip
    assert queued_request_ids(merged_list) == {"y1", "y2", "x1"}
    assert [b.batch_id for b in merged_list] == [8, 7]
    merged_list = merge_work_lists(_work([("y1", 8), ("y2", 8)]), _work([("x1", 7)]))
    assert queued_request_ids(merged_list) == {"y1", "y2", "x1"}
    # and taking several out at once
    assert remove_requests(merged_list, {"y1", "x1", "zz"})
    assert queued_request_ids(merged_list) == {"y2"}
    queue = prefill_queue_of(own_raw)
    assert remove_requests(queue, {"a1", "b1"}) and queued_request_ids(queue) == {"a2"}
    assert remove_requests(queue, {"zz"}) is False


def _work(items: list[tuple[str, int]]) -> DecodeWorkList:
    work = DecodeWorkList()
    for rid, batch in items:
        work.add(Request(rid, rid[0], 0.0, 10, 4), batch)
    return work
