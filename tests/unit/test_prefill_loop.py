"""The prefill instance's loop (Algorithm 1's execution side) on an in-memory worker."""

from __future__ import annotations

import pytest
from aegaeon_common.messages.prefill import CancelRequest, EnqueuePrefill
from aegaeon_common.messages.report import PrefillDone
from aegaeon_common.messages.structs import SamplingSpec
from aegaeon_prefill.loop import PrefillLoop
from aegaeon_sched import LatencyModel
from fake_worker import FakeWorker, Outbox, TimedInbox, latency_model, token_at


def _job(rid: str, model: str, group: int, prompt_len: int, at_s: float) -> EnqueuePrefill:
    spec = SamplingSpec(max_tokens=8, temperature=0.0)
    return EnqueuePrefill(rid, model, group, list(range(prompt_len)), spec, at_s)


def test_groups_run_in_order_with_the_next_model_prefetched() -> None:
    w = FakeWorker(latency_model(["a", "b"], switch_s=0.05), kind="prefill")
    timed = [(0.0, _job("a1", "a", 0, 40, 0.0)), (0.0, _job("b1", "b", 1, 30, 0.0)),
             (0.0, _job("a2", "a", 0, 20, 0.0)), (0.0, _job("b2", "b", 1, 10, 0.0)),
             (0.0, CancelRequest("b2"))]  # fmt: skip
    inbox, outbox = TimedInbox(w.clock, timed), Outbox()
    estimator = LatencyModel.from_dict(w.truth.to_dict())
    loop = PrefillLoop(w, inbox, outbox, clock=w.clock, profile=lambda: estimator)
    loop.run(inbox.stop)
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
