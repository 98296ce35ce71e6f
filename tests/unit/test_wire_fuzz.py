"""Bad frames on every channel end as a typed WireError (never another exception), the
cachemgr's ROUTER answers each with a typed ErrorReply and keeps serving, and no
product code can unpickle anything."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import struct
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from aegaeon_bench.reliability.fuzz_inputs import zmq_frames
from aegaeon_common.messages.cache import REPLIES, REQUESTS, GetStats, UnpinModel
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.messages.decode import DECODE_CHANNEL, HYBRID_CHANNEL, EnqueueDecode
from aegaeon_common.messages.prefill import PREFILL_CHANNEL, CancelRequest, EnqueuePrefill
from aegaeon_common.messages.report import REPORT_CHANNEL, InstanceStats
from aegaeon_common.messages.structs import EventSpec, KVHandoff, KVShapeSpec, SamplingParams
from aegaeon_common.transport import MAX_FRAME_BYTES, RpcServer
from aegaeon_common.wire import Channel, Message, WireError, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("AEGAEON_FUZZ_EXAMPLES", "120"))
CODES = {"malformed", "bad_version", "unknown_tag", "missing_field", "bad_field"}
CHANNELS = [REPORT_CHANNEL, PREFILL_CHANNEL, DECODE_CHANNEL, HYBRID_CHANNEL, REQUESTS, REPLIES]
SAMPLING = SamplingParams(max_tokens=4)
VALID = [
    encode(EnqueuePrefill("r1", "m", 0, [1, 2, 3], SAMPLING, 0.0, incarnation=7)),
    encode(EnqueueDecode(request_id="r1", model="m", batch_id=1, prompt_len=3, first_token_id=4,
                         num_generated=1, sampling=SAMPLING,
                         handoff=KVHandoff(KVShapeSpec(2, 2, 64, 16, "bfloat16"), [0, 4096], 3,
                                           EventSpec("cpu", "t", 0, 1)),
                         arrival_s=0.0)),
    encode(CancelRequest("r1")),
    encode(InstanceStats("decode", 0, None, 0, 0, {"x": 1.0})),
    encode(GetStats()),
    encode(UnpinModel("m", "w")),
]  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(CHANNELS), zmq_frames(VALID, max_frame_bytes=4096))
def test_any_frame_decodes_to_a_message_of_the_channel_or_a_typed_wire_error(
    channel: Channel, frame: bytes
) -> None:
    try:
        msg = channel.decode(frame)
    except WireError as exc:
        assert exc.code in CODES, exc
    else:
        assert isinstance(msg, Message) and msg.TAG in channel.tags


async def test_the_router_answers_every_bad_frame_and_survives_an_oversized_one(
    tmp_path: Path,
) -> None:
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp_path / 'rpc.sock'}"

    async def handler(msg: Message) -> Message:
        return ErrorReply("ok", msg.TAG)

    server = RpcServer(ctx, address, REQUESTS, handler)
    serving = asyncio.create_task(server.serve_forever())
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    rid = struct.pack("<Q", 1)
    bad = [b"", b"\xc1", msgspec.msgpack.encode({"t": "nope", "v": 1}),
           msgspec.msgpack.encode({"t": "cache.stats", "v": 2}), VALID[4][:-1],
           msgspec.msgpack.encode([1, 2, 3])]  # fmt: skip
    for frame in bad:
        await dealer.send_multipart([rid, frame])
        _, reply = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
        decoded = msgspec.msgpack.decode(reply)
        assert decoded["t"] == "error" and decoded["code"] in CODES, decoded
    await dealer.send_multipart([b"\x00" * 3])  # no request id frame
    _, reply = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
    assert msgspec.msgpack.decode(reply)["code"] == "malformed"
    await dealer.send_multipart([rid, b"\x00" * (MAX_FRAME_BYTES + 1)])  # dropped unread
    await asyncio.sleep(0.3)
    await dealer.send_multipart([rid, VALID[4]])  # the connection comes back
    _, reply = await asyncio.wait_for(dealer.recv_multipart(), 10.0)
    assert msgspec.msgpack.decode(reply) == {"t": "error", "code": "ok",
                                             "message": GetStats.TAG, "detail": None,
                                             "v": 1}  # fmt: skip
    assert server.num_bad_frames == len(bad) + 1
    serving.cancel()
    dealer.close(0)
    server.close()
    ctx.term()


PRODUCT = ["libs", "services", "tools", "bench", "sim"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal",
                  "joblib"}  # fmt: skip
UNSAFE_CALLS = [
    re.compile(r"\b(recv|send)_pyobj\b"),
    re.compile(r"\ballow_pickle\s*=\s*True"),
    re.compile(r"\byaml\.load\("),
    re.compile(r"\byaml\.unsafe_load\("),
    re.compile(r"\bPickle(r|Serializer)\b"),
]


def _python_files() -> list[Path]:
    root = Path(__file__).resolve().parents[2]
    return [p for d in PRODUCT for p in (root / d).rglob("*.py") if ".venv" not in p.parts]


def test_no_product_code_can_unpickle() -> None:
    """Never pickle: no pickle-family import, no pyobj sockets, no unsafe loaders, and
    every torch.load says weights_only=True."""
    files = _python_files()
    assert len(files) > 100
    wire = [f for f in files if f.name in ("wire.py", "transport.py") or "messages" in f.parts]
    assert len(wire) >= 8  # the wire modules are among those scanned
    problems = []
    for path in files:
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            problems += [f"{path}: imports {n}" for n in names if n in UNSAFE_MODULES]
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("torch.load"):
                safe = any(k.arg == "weights_only" and ast.unparse(k.value) == "True"
                           for k in node.keywords)  # fmt: skip
                if not safe:
                    problems.append(f"{path}:{node.lineno}: torch.load without weights_only")
        problems += [f"{path}: {rx.pattern}" for rx in UNSAFE_CALLS if rx.search(text)]
    assert not problems, problems


@pytest.mark.parametrize("channel", CHANNELS, ids=lambda c: c.name)
def test_a_message_queued_for_another_process_says_which(channel: Channel) -> None:
    """Work messages carry the incarnation they are for (0 = any, older peers)."""
    for tag in channel.tags & {"enqueue_prefill", "enqueue_decode", "run_request"}:
        cls = channel._types[tag]
        assert "incarnation" in cls.__struct_fields__
