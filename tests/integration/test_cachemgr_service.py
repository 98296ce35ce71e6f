"""The cachemgr process: bad frames, restarts, one instance per run, no shared memory left."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import zmq
from aegaeon_common.messages.cache import CacheStats, GetStats
from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.wire import Channel, encode
from aegaeon_runtime.cacheclient.client import CacheClient
from cachemgr_harness import CacheMgrProcess, checkpoint, shm_segments, write_config

REPLY_CHANNEL = Channel("test.replies", [ErrorReply, CacheStats])
RID = (7).to_bytes(8, "little")


def call_raw(address: str, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes]:
    """Send raw frames on a DEALER; return the reply frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        return sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()


def error_code(frames: list[bytes]) -> str:
    reply = REPLY_CHANNEL.decode(frames[-1])
    assert isinstance(reply, ErrorReply), reply
    return reply.code


def test_bad_frames_get_error_replies_and_service_keeps_serving(tmp_path: Path) -> None:
    with CacheMgrProcess(write_config(tmp_path, {"a": checkpoint(0)})) as cm:
        address = cm.config.cachemgr_address
        wrong_version = msgpack.packb({"v": 99, "t": GetStats.TAG})
        bad_field = msgpack.packb({"v": 1, "t": "cache.alloc_blocks", "owner": 5})
        cases = {
            "malformed": [RID, b"\xc1 not msgpack"],
            "bad_version": [RID, wrong_version],
            "unknown_tag": [RID, msgpack.packb({"v": 1, "t": "cache.nope"})],
            "bad_field": [RID, bad_field],
        }
        for code, frames in cases.items():
            reply = call_raw(address, frames)
            assert reply[0] == RID and error_code(reply) == code
        assert error_code(call_raw(address, [b"only one frame"])) == "malformed"
        ok = call_raw(address, [RID, encode(GetStats())])
        assert isinstance(REPLY_CHANNEL.decode(ok[1]), CacheStats)
        assert cm.proc is not None and cm.proc.poll() is None
        assert cm.stop() == 0
    assert shm_segments(cm.prefix) == []


def test_restarts_leave_no_shared_memory(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"a": checkpoint(0)}, prewarm=["*"])
    first = CacheMgrProcess(config).start()
    prefix = first.prefix
    assert len(shm_segments(prefix)) >= 2  # KV region, event table (+ the prewarmed model)

    # One cachemgr per run directory: a second one refuses to start.
    second = subprocess.run(
        [sys.executable, "-m", "aegaeon_cli.main", "cachemgr", "--config", str(config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1 and "another cachemgr" in second.stderr
    assert first.proc is not None and first.proc.poll() is None

    assert first.stop(signal.SIGTERM) == 0
    assert shm_segments(prefix) == []

    crashed = CacheMgrProcess(config).start()
    asyncio.run(load(crashed, "a"))
    left = shm_segments(prefix)
    assert crashed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert shm_segments(prefix) == left  # a crash leaves them behind ...

    restarted = CacheMgrProcess(config).start()  # ... and the next start removes them
    assert not set(shm_segments(prefix)) & set(left)
    assert "stale_segments_removed" in restarted.log()
    asyncio.run(load(restarted, "a"))
    assert restarted.stop(signal.SIGINT) == 0
    assert shm_segments(prefix) == []


async def load(cm: CacheMgrProcess, name: str) -> None:
    client = CacheClient(cm.config.cachemgr_address, "w0")
    await client.register()
    model = await client.load_model(name)
    assert model.nbytes > 0
    await client.close()


def test_a_worker_that_registers_before_its_cachemgr_is_up_waits_for_it(tmp_path: Path) -> None:
    # A node starts its instances beside its cachemgr: a registration sent before the
    # cachemgr binds outlasts the client's call timeout and is answered once it is up.
    cm = CacheMgrProcess(write_config(tmp_path, {"a": checkpoint(0)}))

    async def register_early() -> None:
        client = CacheClient(cm.config.cachemgr_address, "early", timeout_s=0.2)
        try:
            registering = asyncio.ensure_future(client.register())
            await asyncio.wait([registering], timeout=0.4)  # past the call timeout
            assert not registering.done()
            await asyncio.to_thread(cm.start)
            registration = await registering
            assert registration.worker_id == "early"
            stats = await client.stats()
            assert [w.worker_id for w in stats.workers] == ["early"]
            model = await client.load_model("a")
            assert model.nbytes > 0
        finally:
            await client.close()

    try:
        asyncio.run(register_early())
        assert cm.stop() == 0
    finally:
        if cm.proc is not None and cm.proc.poll() is None:
            cm.stop(signal.SIGKILL)
    assert shm_segments(cm.prefix) == []
