"""Algorithms 1 and 2 over shared state make the single proxy's decisions, step for step."""

from __future__ import annotations

import random

import pytest
from aegaeon_sched import (
    DecodeDispatcher,
    DecodeWorkList,
    LatencyModel,
    ModelSpec,
    NoInstance,
    PrefillDispatcher,
    Request,
)
from aegaeon_sched.shared import (
    State,
    dispatch_prefill,
    merge_prefill_states,
    merge_work_lists,
    place_decode,
    prefill_done,
    prefill_queue_from_state,
    prefill_queue_state,
    queued_request_ids,
    remove_from_prefill,
    remove_from_work_list,
    remove_requests,
    work_list_state,
)


def _latency() -> LatencyModel:
    specs = [ModelSpec(m, 64, 128, 1, int(0.5e9), 1) for m in "abcd"]
    lat = LatencyModel(specs, pcie_bytes_per_s=1e9, decode_per_seq_term=True)
    width = specs[0].layer_width
    lat.set_prefill_coefficients("*", [1e-3 / width, 0.0, 0.0])
    lat.set_decode_coefficients("*", [0.0025 / width, 0.0, 0.001 / width])
    return lat


def test_prefill_over_states_equals_the_live_dispatcher() -> None:
    """200 random arrivals, completions and cancels: the live PrefillDispatcher and a
    state that goes through plain data at every step choose the same instance and
    the same group every time (group ids minted alike)."""
    rng = random.Random(7)
    lat = _latency()
    names = ["n0/prefill-0", "n1/prefill-0", "n2/prefill-0"]
    live = PrefillDispatcher(names, lat, max_group_size=4)
    states: dict[str, State | None] = dict.fromkeys(names)
    queued: list[tuple[str, str]] = []
    next_id = 0
    for step in range(200):
        now = step * 0.01
        roll = rng.random()
        if roll < 0.6 or not queued:
            req = Request(f"r{step}", rng.choice("abcd"), now, rng.randint(10, 400), 16)
            want = live.dispatch(req, now)
            instance, group, state = dispatch_prefill(states, req, lat, now, new_group_id=next_id,
                                                      max_group_size=4)  # fmt: skip
            next_id = max(next_id, group + 1)
            states[instance] = state
            assert (instance, group) == want
            queued.append((instance, req.request_id))
        else:
            instance, rid = queued.pop(rng.randrange(len(queued)))
            if roll < 0.85:
                expected = live.on_done(instance, rid, now)
                states[instance], done = prefill_done(states[instance], rid, now, 4)
                assert done == expected
            else:
                assert live.cancel(rid) == instance
                states[instance], removed = remove_from_prefill(states[instance], rid, 4)
                assert removed
        for name in names:  # the whole queue round-trips, loads included
            queue = prefill_queue_from_state(states[name], 4)
            assert prefill_queue_state(queue) == prefill_queue_state(live.queues[name])
            assert queue.load_s(lat, now) == pytest.approx(live.queues[name].load_s(lat, now))


def test_decode_placement_over_states_equals_the_live_dispatcher() -> None:
    rng = random.Random(3)
    lat = _latency()
    names = ["n0/decode-0", "n0/prefill-0"]
    caps = {"n0/decode-0": dict.fromkeys("abcd", 2000), "n0/prefill-0": dict.fromkeys("abcd", 900)}
    live = DecodeDispatcher(names, latency=lat, tbt_s=0.05, max_batch_size=8)
    for name, by_model in caps.items():
        for model, tokens in by_model.items():
            live.set_capacity(name, model, tokens)
    live.set_decode_share("n0/prefill-0", 0.4)
    states: dict[str, State | None] = dict.fromkeys(names)
    placed: list[tuple[str, str]] = []
    next_id = 100
    for step in range(150):
        if rng.random() < 0.65 or not placed:
            req = Request(f"r{step}", rng.choice("abcd"), 0.0, rng.randint(10, 300), 64)
            want = live.place(req)
            instance, batch, state = place_decode(
                states, req, new_batch_id=next_id, capacity_tokens=caps,
                decode_shares={"n0/prefill-0": 0.4}, latency=lat, tbt_s=0.05, max_batch_size=8,
            )  # fmt: skip
            next_id = max(next_id, batch + 1)
            states[instance] = state
            assert (instance, batch - 100) == (want[0], want[1])
            placed.append((instance, req.request_id))
        else:
            instance, rid = placed.pop(rng.randrange(len(placed)))
            assert live.remove(rid) == instance
            states[instance], removed = remove_from_work_list(states[instance], rid)
            assert removed


def test_no_candidate_instance_is_no_instance() -> None:
    with pytest.raises(NoInstance):
        dispatch_prefill({}, Request("r", "a", 0.0, 5, 5), _latency(), 0.0, new_group_id=1)
    with pytest.raises(NoInstance):
        place_decode({}, Request("r", "a", 0.0, 5, 5), new_batch_id=1, capacity_tokens={})


def test_a_malformed_state_is_an_error() -> None:
    with pytest.raises(ValueError):
        prefill_queue_from_state([None, 0.0, [[1, "a", 1, None, []]]])


def test_an_instance_merges_its_own_queues_with_what_the_store_booked_since_a_loss() -> None:
    """The store lost an instance's queue and the replicas booked two requests on the
    empty one since (on their way to the instance): the merge keeps the instance's
    groups, order, loaded model and running request, and adds those two where the
    store put them (one to a group the instance holds, one in a new group)."""
    own_queue = prefill_queue_from_state(None, 4)
    for rid, group in (("a1", 1), ("a2", 1), ("b1", 2)):
        own_queue.add(Request(rid, rid[0], 0.0, 10, 4), group)
    own_queue.start("a1", 5.0)
    own = prefill_queue_state(own_queue)
    booked = prefill_queue_from_state(None, 4)
    booked.add(Request("a3", "a", 1.0, 10, 4), 1)  # joined the open group of a
    booked.add(Request("c1", "c", 1.0, 10, 4), 3)
    merged = prefill_queue_from_state(merge_prefill_states(own, prefill_queue_state(booked), 4))
    assert merged.loaded_model == "a" and merged.running() is not None
    assert [(g.group_id, [r.request_id for r in g.pending]) for g in merged] == [
        (1, ["a2", "a3"]), (2, ["b1"]), (3, ["c1"])]
    assert [g.num_added for g in merged] == [3, 1, 1]
    assert merge_prefill_states(own, None, 4) == own  # (nothing booked since)
    # a decode work list likewise
    placed = work_list_state(_work([("x1", 7)]))
    own_list = work_list_state(_work([("y1", 8), ("y2", 8)]))
    merged_list = merge_work_lists(own_list, work_list_state(_work([("y2", 8), ("x1", 7)])))
    assert queued_request_ids(merged_list, False) == {"y1", "y2", "x1"}
    assert [b[0] for b in merged_list] == [8, 7]
    assert queued_request_ids(merge_work_lists(own_list, placed), False) == {"y1", "y2", "x1"}
    # and taking several out at once
    state, removed = remove_requests(merged_list, {"y1", "x1", "zz"}, prefill=False)
    assert removed and queued_request_ids(state, False) == {"y2"}
    state, removed = remove_requests(own, {"a1", "b1"}, prefill=True, max_group_size=4)
    assert removed and queued_request_ids(state, True) == {"a2"}
    assert remove_requests(state, {"zz"}, prefill=True)[1] is False


def _work(items: list[tuple[str, int]]) -> DecodeWorkList:
    work = DecodeWorkList()
    for rid, batch in items:
        work.add(Request(rid, rid[0], 0.0, 10, 4), batch)
    return work
