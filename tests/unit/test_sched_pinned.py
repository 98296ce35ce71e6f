"""ServerlessLLM (FCFS) and ServerlessLLM+ (oracle SJF) as the paper evaluated
them: requests bound to an instance's queue at arrival."""

from __future__ import annotations

from aegaeon_sched import (
    Cancel,
    PinnedRequestLevelPolicy,
    RequestLevelPolicy,
)
from sched_support import req, run_actions


def _busy(policy: RequestLevelPolicy) -> None:
    """g0 runs a long x, g1 a short y: neither can take another model."""
    assert run_actions(policy.on_arrival(req(0, "x", 0.0, out=1000), 0.0)) == [("g0", "r0", "x")]
    assert run_actions(policy.on_arrival(req(1, "y", 0.1, out=10), 0.1)) == [("g1", "r1", "y")]


def test_names() -> None:
    assert PinnedRequestLevelPolicy(["g0"]).name == "request-level"
    assert PinnedRequestLevelPolicy(["g0"], sjf=True).name == "request-level-sjf"
    assert RequestLevelPolicy(["g0"]).name == "request-level-global"
    assert RequestLevelPolicy(["g0"], sjf=True).name == "request-level-global-sjf"


def test_bound_requests_wait_for_their_instance_even_if_another_goes_idle() -> None:
    for policy, expect in ((RequestLevelPolicy(["g0", "g1"]), "g1"),
                           (PinnedRequestLevelPolicy(["g0", "g1"]), None)):  # fmt: skip
        _busy(policy)
        assert policy.on_arrival(req(2, "z", 0.2), 0.2) == []  # nowhere to start
        runs = run_actions(policy.on_request_finished("r1", 1.0))  # g1 goes idle
        if expect is None:
            assert runs == []  # z is bound behind x on g0 (least recently used)
            assert run_actions(policy.on_request_finished("r0", 10.0)) == [("g0", "r2", "z")]
        else:
            assert runs == [("g1", "r2", "z")]


def test_fcfs_serves_its_queue_in_order_batching_only_the_heads_run() -> None:
    p = PinnedRequestLevelPolicy(["g0"])
    p.on_arrival(req(0, "x", 0.0, out=1000), 0.0)
    for i, m in enumerate("yzyy", start=1):
        assert p.on_arrival(req(i, m, 0.1 * i), 0.1 * i) == []
    assert [r.request_id for r in p.pinned["g0"]] == ["r1", "r2", "r3", "r4"]
    # x ends: the head y runs alone (z is next), then z, then the tail's two ys.
    assert run_actions(p.on_request_finished("r0", 10.0)) == [("g0", "r1", "y")]
    assert run_actions(p.on_request_finished("r1", 11.0)) == [("g0", "r2", "z")]
    assert run_actions(p.on_request_finished("r2", 12.0)) == [("g0", "r3", "y"), ("g0", "r4", "y")]


def test_sjf_serves_the_shortest_bound_request_with_its_model_mates() -> None:
    p = PinnedRequestLevelPolicy(["g0"], sjf=True)
    p.on_arrival(req(0, "x", 0.0, out=1000), 0.0)
    p.on_arrival(req(1, "y", 0.1, out=400), 0.1)
    p.on_arrival(req(2, "z", 0.2, out=300), 0.2)
    p.on_arrival(req(3, "y", 0.3, out=10), 0.3)
    # The shortest is r3 (y): it runs with the other y, shortest first.
    assert run_actions(p.on_request_finished("r0", 10.0)) == [("g0", "r3", "y"), ("g0", "r1", "y")]
    assert run_actions(p.on_request_finished("r3", 10.5)) == []  # r1 still runs
    assert run_actions(p.on_request_finished("r1", 14.0)) == [("g0", "r2", "z")]


def test_binding_prefers_a_queue_that_batches_the_request() -> None:
    for sjf, target in ((False, "g1"), (True, "g0")):
        p = PinnedRequestLevelPolicy(["g0", "g1"], sjf=sjf)
        _busy(p)
        p.on_arrival(req(2, "z", 0.2), 0.2)  # -> g0 (least recently used)
        p.on_arrival(req(3, "w", 0.3), 0.3)  # -> g1 (shorter queue)
        p.on_arrival(req(4, "v", 0.4), 0.4)  # -> g0 (tie: least recently used)
        # Another z: FCFS batches only with a queue's tail (no tail is z: the
        # shortest queue, g1); SJF with any queued z (g0).
        p.on_arrival(req(5, "z", 0.5), 0.5)
        assert "r5" in [r.request_id for r in p.pinned[target]]


def test_a_finish_on_a_busy_instance_pulls_same_model_requests() -> None:
    for sjf, pulled in ((False, []), (True, [("g0", "r3", "x")])):
        p = PinnedRequestLevelPolicy(["g0"], sjf=sjf, max_batch_size=2)
        p.on_arrival(req(0, "x", 0.0, out=1000), 0.0)
        assert len(p.on_arrival(req(1, "x", 0.1), 0.1)) == 1  # joins the warm batch
        p.on_arrival(req(2, "y", 0.2), 0.2)  # batch full: bound
        p.on_arrival(req(3, "x", 0.3), 0.3)  # bound behind y
        # FCFS: the head (y) is another model, nothing joins; SJF: the x joins.
        assert run_actions(p.on_request_finished("r1", 1.0)) == pulled


def test_cancel_while_bound_leaves_the_queue() -> None:
    p = PinnedRequestLevelPolicy(["g0"])
    p.on_arrival(req(0, "x", 0.0), 0.0)
    p.on_arrival(req(1, "y", 0.1), 0.1)
    p.on_arrival(req(2, "z", 0.2), 0.2)
    assert p.on_request_cancelled("r1", 0.3) == []
    acts = p.on_request_cancelled("r0", 0.4)
    assert acts[0] == Cancel("g0", "r0")
    assert run_actions(acts[1:]) == [("g0", "r2", "z")]
