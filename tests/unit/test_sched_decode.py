"""Algorithm 2, line 2: decode placement, and the work list both sides keep."""

from __future__ import annotations

import pytest
from aegaeon_sched import DecodeDispatcher, DecodeWorkList, Request


def _req(i: int, model: str, prompt: int = 100, max_tokens: int = 100) -> Request:
    return Request(f"r{i}", model, 0.0, prompt, max_tokens)


def test_joins_a_batch_with_room_on_any_instance() -> None:
    d = DecodeDispatcher(["d0", "d1"])
    assert d.place(_req(0, "a")) == ("d0", 0)
    assert d.place(_req(1, "b")) == ("d1", 1)
    assert d.place(_req(2, "b")) == ("d1", 1)  # b's batch on d1, though d0 is scanned first
    assert d.place(_req(3, "a")) == ("d0", 0)
    assert [len(b) for b in d.work_lists["d0"]] == [2]


def test_kv_room_and_max_batch_size_open_new_batches_on_the_shortest_list() -> None:
    d = DecodeDispatcher(["d0", "d1", "d2"], max_batch_size=3)
    d.set_capacity("d0", "a", 450)  # room for two requests of 200 tokens
    d.place(_req(0, "a"))  # d0, batch 0
    d.place(_req(1, "x"))  # d1
    d.place(_req(2, "y"))  # d2
    assert d.place(_req(3, "a")) == ("d0", 0)  # 400 <= 450
    inst, bid = d.place(_req(4, "a"))  # 600 > 450: new batch on the shortest list
    assert bid != 0 and inst == "d0"  # every list has 1 batch: the first one wins
    # max batch size: d1's x batch takes 3 then overflows to the shortest list
    assert d.place(_req(5, "x")) == ("d1", 1)
    assert d.place(_req(6, "x")) == ("d1", 1)
    inst7, bid7 = d.place(_req(7, "x"))
    assert inst7 == "d1" and bid7 != 1  # d0 has 2 batches, d1 and d2 one each


def test_requests_leave_on_finish_and_empty_batches_vanish() -> None:
    d = DecodeDispatcher(["d0"])
    d.place(_req(0, "a"))
    d.place(_req(1, "a"))
    assert d.remove("r0") == "d0"
    assert len(d.work_lists["d0"]) == 1
    assert d.remove("r1") == "d0"
    assert len(d.work_lists["d0"]) == 0
    assert d.remove("r1") is None


def test_group_by_model_is_stable() -> None:
    wl = DecodeWorkList()
    for bid, model in enumerate("abacb"):
        wl.add(_req(bid, model), bid)
    ordered = wl.group_by_model()
    assert [(b.batch_id, b.model) for b in ordered] == [
        (0, "a"), (2, "a"), (1, "b"), (4, "b"), (3, "c"),
    ]  # fmt: skip
    assert [b.batch_id for b in wl] == [0, 2, 1, 4, 3]


def test_reserved_tokens_track_prompt_plus_max_tokens() -> None:
    wl = DecodeWorkList()
    batch = wl.add(_req(0, "a", 30, 70), 5)
    wl.add(_req(1, "a", 10, 10), 5)
    assert batch.reserved_tokens == 120
    wl.remove("r0")
    assert batch.reserved_tokens == 20


def test_new_batches_go_where_decode_time_per_batch_is_lowest() -> None:
    from aegaeon_sched import DecodeDispatcher, Request

    dispatcher = DecodeDispatcher(["decode-0", "prefill-0"], max_batch_size=1)
    dispatcher.set_decode_share("prefill-0", 0.25)  # a hybrid busy 75% with prefills

    def place(i: int) -> str:
        return dispatcher.place(Request(f"r{i}", f"m{i}", 0.0, 8, 8))[0]

    # Equal shares would alternate; with a quarter share the hybrid takes a new
    # batch only once the decode instance holds about four times as many.
    placed = [place(i) for i in range(10)]
    assert placed.count("decode-0") == 8 and placed.count("prefill-0") == 2
    dispatcher.set_decode_share("prefill-0", 1.0)
    assert place(10) == "prefill-0"  # 8 vs 2 batches at equal shares


def _demand_dispatcher(share: float) -> DecodeDispatcher:
    """decode-0 plus a hybrid at ``share``; steps of 2.5 ms + 1 ms per sequence, TBT 20 ms."""
    from aegaeon_sched import LatencyModel, ModelSpec

    specs = [ModelSpec(m, 64, 128, 1, 1_000_000, 1) for m in "abc"]
    lat = LatencyModel(specs, pcie_bytes_per_s=1e9, decode_per_seq_term=True)
    width = specs[0].layer_width
    lat.set_decode_coefficients("*", [0.0025 / width, 0.0, 0.001 / width])
    dispatcher = DecodeDispatcher(["decode-0", "prefill-0"], latency=lat, tbt_s=0.02)
    dispatcher.set_decode_share("prefill-0", share)
    return dispatcher


def test_demand_is_step_time_over_tbt_per_unit_of_share() -> None:
    d = _demand_dispatcher(0.5)
    d.place(_req(0, "a"))  # decode-0: (2.5 + 1) ms / 20 ms = 0.175
    assert d.load("decode-0") == pytest.approx(0.175)
    assert d.load("decode-0", _req(1, "a"), join=0) == pytest.approx(0.225)  # +1 ms
    assert d.load("decode-0", _req(1, "b")) == pytest.approx(0.35)  # a new batch: +3.5 ms
    assert d.load("prefill-0", _req(1, "b")) == pytest.approx(0.35)  # 0.175 at half a share


def test_a_model_with_a_steady_stream_is_not_pinned_to_an_overloaded_instance() -> None:
    """The paper's rule joins a model's batch wherever it is; a model whose batch
    never empties then stays on that instance however loaded. Joins stand while
    the instance keeps up (demand <= 1); past that the request goes where the
    resulting demand is lowest."""
    d = _demand_dispatcher(0.2)  # the hybrid: 20% of its time left for decoding
    d.work_lists["prefill-0"].add(_req(0, "a"), 100)  # placed while the hybrid was idle
    placed = [d.place(_req(i, "a")) for i in range(1, 8)]
    # On the hybrid a batch of n costs (2.5 + n) ms / 20 ms / 0.2: it keeps up to n = 1.5.
    assert {p for p in placed} == {("decode-0", placed[0][1])}  # one new batch
    assert placed[0][1] != 100
    assert len(d.work_lists["prefill-0"].batch(100) or []) == 1
    # Without a latency model: the paper's rule, every request joins the batch.
    paper = DecodeDispatcher(["decode-0", "prefill-0"])
    paper.set_decode_share("prefill-0", 0.2)
    paper.work_lists["prefill-0"].add(_req(0, "a"), 100)
    assert {paper.place(_req(i, "a")) for i in range(1, 8)} == {("prefill-0", 100)}


def test_joins_are_kept_while_the_instance_keeps_up() -> None:
    d = _demand_dispatcher(1.0)
    d.place(_req(0, "a"))  # decode-0
    d.place(_req(1, "b"))  # prefill-0 (decode-0 would be 0.35, prefill-0 0.175)
    # a's batch grows on decode-0 though prefill-0 is less loaded: 17 sequences
    # cost (2.5 + 17) ms / 20 ms = 0.975 <= 1.
    assert {d.place(_req(i, "a"))[0] for i in range(2, 18)} == {"decode-0"}
    inst, _ = d.place(_req(18, "a"))  # 1.025: a new batch on prefill-0 (0.35)
    assert inst == "prefill-0"
