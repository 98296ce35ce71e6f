"""The prefill instance's loop (Algorithm 1's execution side) on an in-memory worker."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from aegaeon_common.messages.prefill import AddModel, CancelRequest, EnqueuePrefill
from aegaeon_common.messages.report import InstanceModels, PrefillDone, RequestFailed
from aegaeon_common.messages.structs import SamplingParams
from aegaeon_runtime.port import ModelGoneError, ModelUnavailableError
from aegaeon_runtime.prefill.loop import PrefillLoop
from fake_worker import FakeWorker, latency_model, run_loop, token_at


def _job(rid: str, model: str, group: int, prompt_len: int, at_s: float) -> EnqueuePrefill:
    spec = SamplingParams(max_tokens=8, temperature=0.0)
    return EnqueuePrefill(rid, model, group, list(range(prompt_len)), spec, at_s)


def test_groups_run_in_order_with_the_next_model_prefetched() -> None:
    w = FakeWorker(latency_model(["a", "b"], switch_s=0.05), kind="prefill")
    timed = [(0.0, _job("a1", "a", 0, 40, 0.0)), (0.0, _job("b1", "b", 1, 30, 0.0)),
             (0.0, _job("a2", "a", 0, 20, 0.0)), (0.0, _job("b2", "b", 1, 10, 0.0)),
             (0.0, CancelRequest("b2"))]  # fmt: skip
    loop, outbox = run_loop(PrefillLoop, w, timed)
    done = outbox.of_type(PrefillDone)
    # Group a (both of its requests) first, then group b; b2 was cancelled.
    assert [(d.request_id, d.token_id) for d in done] == [
        ("a1", token_at(39)), ("a2", token_at(19)), ("b1", token_at(29))
    ]
    assert w.switcher.activations == ["a", "b"]
    assert w.switcher.prefetches[0] == "b"  # loaded behind group a
    # Each handoff names the prompt's blocks in the host cache; the device ones are free.
    assert [len(d.handoff.block_offsets) for d in done] == [3, 2, 2]
    assert w.kv.device_bytes_used() == 0
    # The clock: two switches and 90 prompt tokens at 0.1 ms each.
    assert w.clock.now() == pytest.approx(0.05 * 2 + 90 * 1e-4)
    assert loop.stats().counters["prefills"] == 3


def test_an_added_model_is_served_without_a_restart_and_urgent_groups_go_first() -> None:
    w = FakeWorker(latency_model(["a"], switch_s=0.05), kind="prefill")
    batch = EnqueuePrefill("b1", "a", 0, list(range(40)), SamplingParams(max_tokens=8), 0.0,
                           priority=2, ttft_s=10.0)  # fmt: skip
    urgent = EnqueuePrefill("n1", "new", 1, list(range(10)), SamplingParams(max_tokens=8), 0.0,
                            priority=0, ttft_s=0.5)  # fmt: skip
    timed = [(0.0, AddModel("new", "/market/3")), (0.0, batch), (0.0, urgent)]
    loop, outbox = run_loop(PrefillLoop, w, timed)
    (models,) = outbox.of_type(InstanceModels)
    assert set(models.capacity_tokens) == {"a", "new"} and models.capacity_tokens["new"] > 0
    assert models.latency is not None and "new" in models.latency.models
    assert "new" in loop.latency.specs  # the loop's own estimates cover it now
    # The interactive request of the new model ran first, although it was queued last.
    assert [d.request_id for d in outbox.of_type(PrefillDone)] == ["n1", "b1"]


def test_a_prompt_waits_for_blocks_of_copies_in_flight_and_only_a_too_large_one_fails() -> None:
    # 16 blocks of device KV; a 150-token prompt takes 10. The first prompt's blocks
    # go back to the pool only when its swap-out copy completes, 0.2 s after it
    # started: the second prompt (which fits the region) waits for them, queued,
    # instead of failing; a 300-token prompt (19 blocks) can never fit and fails.
    w = FakeWorker(latency_model(["a"], switch_s=0.05), kind="prefill",
                   kv_region_bytes=16 * 8192, slab_bytes=8192)  # fmt: skip
    w.kv.swap_out_s = 0.2
    timed = [(0.0, _job("p1", "a", 0, 150, 0.0)), (0.0, _job("p2", "a", 0, 150, 0.0)),
             (0.0, _job("huge", "a", 1, 300, 0.0)),
             (1.0, CancelRequest("nothing"))]  # keeps the inbox open until t = 1 s  # fmt: skip
    loop, outbox = run_loop(PrefillLoop, w, timed)
    done = {d.request_id: d for d in outbox.of_type(PrefillDone)}
    assert set(done) == {"p1", "p2"}
    assert done["p2"].token_id == token_at(149)
    assert done["p2"].emitted_s >= done["p1"].emitted_s + 0.2  # after p1's copy completed
    failed = {f.request_id: (f.code, f.message) for f in outbox.of_type(RequestFailed)}
    assert list(failed) == ["huge"]
    code, message = failed["huge"]
    assert code == "kv_capacity" and "holds at most 16" in message
    w.kv.pool.reclaim()
    assert w.kv.device_bytes_used() == 0
    assert loop.stats().counters["failed"] == 1.0


@pytest.mark.parametrize(("error", "code"), [
    # removed through another proxy replica while the request was on its way here
    (ModelGoneError, "unknown_model"),
    # its checkpoint cannot be read (the cachemgr quarantined it)
    (ModelUnavailableError, "model_unavailable"),
])  # fmt: skip
def test_a_prompt_of_a_model_the_cachemgr_refuses_fails_and_the_next_runs(
    error: type[ModelGoneError], code: str
) -> None:
    w = FakeWorker(latency_model(["a", "b"], switch_s=0.05), kind="prefill")
    activate = w.switcher.activate
    why = "/m/b/model.safetensors: file truncated inside the tensor data"

    def refusing(name: str, now_s: float | None = None) -> Any:
        if name == "b":
            raise error(name, why)
        return activate(name, now_s)

    w.switcher.activate = refusing  # type: ignore[method-assign]
    timed = [(0.0, _job("b1", "b", 0, 30, 0.0)), (0.0, _job("a1", "a", 1, 30, 0.0))]
    _, outbox = run_loop(PrefillLoop, w, timed)
    (failed,) = outbox.of_type(RequestFailed)
    assert (failed.request_id, failed.code) == ("b1", code) and why in failed.message
    assert [d.request_id for d in outbox.of_type(PrefillDone)] == ["a1"]
    assert w.kv.device_bytes_used() == 0  # b1's blocks went back


def test_each_prefill_leaves_with_what_the_instance_still_holds() -> None:
    """A request out of the queue (handed on, or finished at its first token) is no
    longer counted in the reading its message carries (issue 43)."""
    w = FakeWorker(latency_model(["a"]), kind="prefill")
    one = EnqueuePrefill("one", "a", 0, list(range(20)), SamplingParams(max_tokens=1), 0.0)
    timed = [(0.0, _job("a1", "a", 0, 40, 0.0)), (0.0, _job("a2", "a", 0, 20, 0.0)),
             (0.0, one)]  # fmt: skip
    _, outbox = run_loop(PrefillLoop, w, timed)
    done = outbox.of_type(PrefillDone)
    assert [d.request_id for d in done] == ["a1", "a2", "one"]
    assert [d.holdings.open_sequences for d in done] == [2, 1, 0]
    assert done[-1].finish_reason == "length" and done[-1].holdings.kv_blocks_in_use == 0
    versions = [d.holdings.version for d in done]
    assert versions == sorted(set(versions))


def test_a_request_for_a_group_that_ends_while_it_travels_keeps_the_groups_place() -> None:
    """The proxy adds a2 to a1's group while a1's prefill runs (its copy of the queue
    still holds the group); the instance reads the message only after a1 is done and
    the group gone. Reopened at the key the proxy gave it, the group runs before the
    group of b queued meanwhile: no switch away from a and back."""
    w = FakeWorker(latency_model(["a", "b"], switch_s=0.05), kind="prefill")
    a1 = _job("a1", "a", 0, 40, 0.0)
    b1 = _job("b1", "b", 1, 30, 0.001)
    a2 = msgspec.structs.replace(_job("a2", "a", 0, 20, 0.02), group_key_s=0.0)
    timed = [(0.0, a1), (0.001, b1), (0.02, a2)]
    _, outbox = run_loop(PrefillLoop, w, timed)
    assert [d.request_id for d in outbox.of_type(PrefillDone)] == ["a1", "a2", "b1"]
    assert w.switcher.activations == ["a", "b"]
