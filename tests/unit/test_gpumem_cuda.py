"""The CUDA backend (device buffer on a GPU, CUDA streams, IPC events, staged loads).

Marked `gpu` and skipped without CUDA; the same API as the CPU tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgpack
import pytest
import torch
from aegaeon_gpumem import (
    CudaEvent,
    DeviceBuffer,
    KVBlockPool,
    copy_chunked,
    make_copy_stream,
    open_event,
)
from aegaeon_gpumem.cuda_copies import CudaCopyStream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SPIN_CYCLES = 200_000_000  # ~0.1-0.2 s of torch.cuda._sleep on current GPUs


def _busy_stream(spins: int = 1) -> CudaCopyStream:
    """A copy stream kept busy for ``spins`` x SPIN_CYCLES: what is recorded on it now
    is still pending for a while."""
    stream = make_copy_stream("cuda")
    assert isinstance(stream, CudaCopyStream)
    with torch.cuda.stream(stream.torch_stream):
        torch.cuda._sleep(SPIN_CYCLES * spins)  # type: ignore[no-untyped-call]
    return stream


def test_device_buffer_on_cuda_promote() -> None:
    buf = DeviceBuffer(8 << 20, kv_bytes=2 << 20, device="cuda")
    assert buf.device.type == "cuda"
    active = buf.alloc(3 << 20)
    prefetch = buf.alloc(2 << 20)
    data = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, device="cuda")
    buf.view(prefetch.offset, prefetch.nbytes).copy_(data)
    moved = buf.promote(prefetch.offset, prefetch.nbytes)
    assert moved.offset == active.offset == 0
    assert torch.equal(buf.view(0, 2 << 20), data)


def test_stream_events_and_wait_event_ordering() -> None:
    a, b = _busy_stream(), make_copy_stream("cuda")
    assert isinstance(b, CudaCopyStream)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).pin_memory()
    mid = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    a.copy(mid, src)
    produced = a.record()
    assert isinstance(produced, CudaEvent)
    b.wait_event(produced)
    b.copy(out, mid)
    done = b.record()
    assert not done.query()
    assert done.wait(30.0)
    assert torch.equal(out.cpu(), src)
    # A process opens its own handle from the local table, not through CUDA IPC.
    assert open_event(produced.handle()) is produced


def test_ipc_event_in_another_process() -> None:
    """The importer opens a still-pending event as a CUDA event and waits for it.

    The child imports torch first and only then gets the handle, so the event
    (seconds of GPU spinning) is still pending when it opens it; an event found
    complete on opening holds no CUDA object (cuda_events.py).
    """
    code = textwrap.dedent("""
        import sys, msgpack
        import aegaeon_gpumem as g
        import torch
        torch.cuda.init()
        print("ready", flush=True)
        ev = g.open_event(msgpack.unpackb(bytes.fromhex(sys.stdin.readline().strip())))
        print(type(ev).__name__, flush=True)
        assert ev.wait(60.0)
        print("ok", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        event = _busy_stream(20).record()
        proc.stdin.write(msgpack.packb(event.handle().to_dict()).hex() + "\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.split() == ["CudaEvent", "ok"], err


def test_copy_chunked_host_to_device_through_stage_buffer() -> None:
    src = torch.randint(0, 256, (80 << 20,), dtype=torch.uint8)  # pageable, > 2 stage slots
    dst = torch.empty(80 << 20, dtype=torch.uint8, device="cuda")
    copy_chunked(dst, src)
    assert torch.equal(dst.cpu(), src)


def test_kv_pool_holds_blocks_until_the_cuda_event() -> None:
    with KVBlockPool(1 << 20, 64 << 10, reclaimer=False) as pool:
        blocks = pool.alloc("s", 4096, 16)
        event = _busy_stream().record()
        pool.free(blocks, event)
        assert pool.stats().pending_blocks == 16
        assert event.wait(30.0)
        assert pool.reclaim() == 16


def test_exported_event_outlives_its_last_local_reference() -> None:
    """A consumer may open a handle after the producer dropped the event (a prefill's
    swap-out event, reclaimed before the decode instance admits the request)."""
    event = _busy_stream(5).record()
    pending = msgpack.packb(event.handle().to_dict()).hex()
    assert event.wait(60.0)
    done = msgpack.packb(event.handle().to_dict()).hex()
    del event  # only the export keep-alive holds it now
    code = textwrap.dedent(f"""
        import msgpack
        import aegaeon_gpumem as g
        for wire in ({pending!r}, {done!r}):
            ev = g.open_event(msgpack.unpackb(bytes.fromhex(wire)))
            assert ev.query() and not isinstance(ev, g.CudaEvent), ev
        print("ok")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
