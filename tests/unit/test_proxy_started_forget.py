"""A new proxy's ``ProxyStarted``: instances drop the old proxy's work and free the
KV handoffs nobody claimed (in-memory worker, fake_worker.py)."""

from __future__ import annotations

import os

from aegaeon_common.messages.prefill import AckDrain, EnqueuePrefill, ProxyStarted
from aegaeon_common.messages.report import PrefillDone, StepTokens
from aegaeon_common.messages.structs import SamplingParams
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_runtime.prefill.loop import PrefillLoop
from aegaeon_sched import LatencyModel
from fake_worker import FakeWorker, Outbox, TimedInbox, latency_model, run_loop

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _job(rid: str, group: int, prompt_len: int, at_s: float) -> EnqueuePrefill:
    return EnqueuePrefill(rid, "a", group, list(range(prompt_len)), GREEDY, at_s)


def _done(outbox: Outbox) -> dict[str, PrefillDone]:
    return {d.request_id: d for d in outbox.of_type(PrefillDone)}


def test_a_prefill_instance_frees_unclaimed_handoffs_and_drops_its_queue() -> None:
    w = FakeWorker(latency_model(["a"]), kind="prefill")
    estimator = LatencyModel.from_dict(w.truth.to_dict())
    first = TimedInbox(w.clock, [(0.0, _job("p1", 0, 40, 0.0)), (0.0, _job("p2", 0, 20, 0.0))])
    outbox = Outbox()
    loop = PrefillLoop(w, first, outbox, clock=w.clock, profile=lambda: estimator)
    loop.run(first.stop)
    old = _done(outbox)
    claimed, unclaimed = old["p1"].handoff, old["p2"].handoff
    assert claimed is not None and unclaimed is not None
    w.cache.moved.update(claimed.block_offsets)  # the old proxy placed p1 on a decoder
    # The old proxy died; the new one's first message comes behind one old job (q1,
    # queued before the death) and ahead of its own work (n1).
    now = w.clock.now()
    second = TimedInbox(w.clock, [(now, _job("q1", 1, 30, now)), (now, ProxyStarted(7)),
                                  (now, _job("n1", 2, 30, now))])  # fmt: skip
    loop.inbox = second
    loop.run(second.stop)
    assert set(_done(outbox)) == {"p1", "p2", "n1"}  # q1 was dropped, n1 ran
    assert w.cache.freed == list(unclaimed.block_offsets)  # p1's claimed blocks untouched
    assert len(loop.handoffs) == 1  # n1's, the new proxy's
    assert w.kv.device_bytes_used() == 0
    # The same proxy again changes nothing; another one frees n1's handoff.
    loop.apply([ProxyStarted(7)])
    assert w.cache.freed == list(unclaimed.block_offsets)
    loop.apply([ProxyStarted(8)])
    n1 = _done(outbox)["n1"].handoff
    assert n1 is not None
    assert w.cache.freed == [*unclaimed.block_offsets, *n1.block_offsets]


def test_a_hybrid_drops_its_sequences_and_queue_and_frees_its_unclaimed_handoff() -> None:
    w = FakeWorker(latency_model(["a"]), kind="prefill")
    timed = [(0.0, w.enqueue("a1", "a", 0, 20, 300, 0.0)),
             (0.0, w.enqueue("a2", "a", 0, 20, 300, 0.0)),
             (0.0, _job("p1", 0, 30, 0.0)),
             (0.2, _job("p2", 1, 30, 0.2)),  # queued for the old proxy, not run
             (0.2, ProxyStarted(3))]  # fmt: skip
    loop, outbox = run_loop(DecodeLoop, w, timed, True)
    done = _done(outbox)
    assert set(done) == {"p1"}
    p1 = done["p1"].handoff
    assert p1 is not None
    assert w.cache.freed == list(p1.block_offsets)  # nobody claimed it
    tokens: dict[str, int] = {}
    for msg in outbox.of_type(StepTokens):
        for item in msg.items:
            tokens[item.request_id] = tokens.get(item.request_id, 0) + len(item.token_ids)
    assert 0 < tokens["a1"] < 299 and 0 < tokens["a2"] < 299  # stopped at t = 0.2
    assert not loop.admission.seqs and not len(loop.work)
    assert loop.counters.cancelled == 2
    assert w.kv.device_bytes_used() == 0  # every device block came back
    assert set(w.kv.host_freed) == set(w.cache.reassigned)  # and every claimed host block
    assert loop.load.prefill_requests == 0 and loop.load.decode_requests == 0


def test_a_stopped_proxys_answer_ends_a_later_drain_at_once_until_a_new_proxy_starts() -> None:
    # A node's stop stops the proxy first; it answers every instance's drain in advance
    # (``AckDrain``: nothing more comes from it), so an idle instance stops at once on
    # its SIGTERM instead of waiting ack_wait_s for an answer that cannot come.
    w = FakeWorker(latency_model(["a"]), kind="prefill")
    estimator = LatencyModel.from_dict(w.truth.to_dict())
    loop = PrefillLoop(w, TimedInbox(w.clock, []), Outbox(), clock=w.clock,
                       profile=lambda: estimator)  # fmt: skip
    loop.drain.ack_wait_s = 3600.0
    loop.apply([ProxyStarted(7), AckDrain(os.getpid())])
    loop.drain.request()
    assert loop.drain.done(idle=True)
    # a new proxy may send work again: a drain waits for its answer
    loop.apply([ProxyStarted(8)])
    assert not loop.drain.done(idle=True)
    loop.apply([AckDrain(os.getpid() + 1)])  # an earlier process's answer
    assert not loop.drain.done(idle=True)
