"""An instance sends each request's messages to the proxy replica that owns it."""

from __future__ import annotations

from pathlib import Path

import zmq
from aegaeon_common.messages.report import REPORT_CHANNEL, PrefillDone, StepTokens, TokenItem
from aegaeon_common.messages.structs import RequestTimings
from aegaeon_runtime.bridge import Outbox


def _pull(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    return sock


def test_step_tokens_split_by_replica_and_unrouted_ones_dropped(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    pull_a, pull_b = _pull(ctx, a), _pull(ctx, b)
    outbox = Outbox(None)  # many replicas: no default proxy
    outbox.route("r1", a)
    outbox.route("r2", b)
    outbox.route("r3", a)
    items = [TokenItem(rid, [i]) for i, rid in enumerate(["r1", "r2", "r3", "r9"])]
    outbox.send(StepTokens(0, items, 1.0))
    outbox.send(PrefillDone("r2", 0, 7, None, None, RequestTimings(), 1.0))
    outbox.send(PrefillDone("unknown", 0, 7, None, None, RequestTimings(), 1.0))
    got_a = REPORT_CHANNEL.decode(pull_a.recv())
    got_b = [REPORT_CHANNEL.decode(pull_b.recv()) for _ in range(2)]
    assert isinstance(got_a, StepTokens)
    assert [i.request_id for i in got_a.items] == ["r1", "r3"]
    assert isinstance(got_b[0], StepTokens) and [i.request_id for i in got_b[0].items] == ["r2"]
    assert isinstance(got_b[1], PrefillDone) and got_b[1].request_id == "r2"
    assert outbox.num_unrouted == 2  # r9's item and the unknown prefill: no replica to go to
    outbox.close()
    for sock in (pull_a, pull_b):
        sock.close(0)
    ctx.term()


def test_one_node_sends_everything_to_its_proxy(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    address = f"ipc://{tmp_path}/p.sock"
    pull = _pull(ctx, address)
    outbox = Outbox(address)
    outbox.send(StepTokens(0, [TokenItem("r1", [1]), TokenItem("r2", [2])], 1.0))
    got = REPORT_CHANNEL.decode(pull.recv())
    assert isinstance(got, StepTokens) and len(got.items) == 2
    outbox.close()
    pull.close(0)
    ctx.term()


def test_a_thread_sending_after_close_is_dropped_not_a_hang(tmp_path: Path) -> None:
    import threading

    address = f"ipc://{tmp_path}/p.sock"
    outbox = Outbox(address)
    msg = PrefillDone("r", 0, 7, None, None, RequestTimings(), 1.0)
    outbox.send(msg)  # this thread's socket exists; the other thread has none yet
    outbox.close()  # returns: nothing is left open in its context
    late = threading.Thread(target=outbox.send, args=(msg,))
    late.start()
    late.join(5.0)
    outbox.send(msg)
    assert not late.is_alive() and outbox.num_dropped == 2


def test_an_answer_goes_to_the_replica_that_asked(tmp_path: Path) -> None:
    """AddModel/SetModelAwake name their reply_to: the answer goes there, with no
    request route and no default proxy (many replicas)."""
    from aegaeon_common.messages.report import InstanceModels, ModelsResident

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    address = f"ipc://{tmp_path}/r.sock"
    pull = _pull(ctx, address)
    outbox = Outbox(None)
    outbox.send(InstanceModels("prefill", 0, 1, {"m": 10}, None, ticket=3, reply_to=address))
    outbox.send(ModelsResident("prefill", 0, 4, ["m"], 2, reply_to=address))
    outbox.send(ModelsResident("prefill", 0, 5, ["m"], 2))  # nobody to answer: dropped
    first, second = (REPORT_CHANNEL.decode(pull.recv()) for _ in range(2))
    assert isinstance(first, InstanceModels) and first.ticket == 3
    assert isinstance(second, ModelsResident) and second.ticket == 4
    assert outbox.num_unrouted == 1
    outbox.close()
    pull.close(0)
    ctx.term()
