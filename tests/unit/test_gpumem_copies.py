"""Copy streams (order, events, wait_event, failure), block copies and chunked copies."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from aegaeon_gpumem import (
    CopyStreamError,
    CpuCopyStream,
    CpuEvent,
    EventTable,
    Timeline,
    byte_copy,
    coalesce,
    copy_blocks,
    copy_chunked,
    make_copy_stream,
)

pytestmark = pytest.mark.usefixtures("no_leaked_segments")


def _pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_jobs_run_in_order_and_events_follow_them(table: EventTable) -> None:
    stream = CpuCopyStream(table, 0)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    first, second = _pattern(1 << 20, 1), _pattern(1 << 20, 2)
    stream.launch_host_func(lambda: time.sleep(0.05))  # keep the copies queued a while
    stream.copy(dst, first)
    e1 = stream.record()
    stream.copy(dst, second)
    e2 = stream.record()
    assert not e1.query() and not e2.query()
    assert e2.wait(5.0)
    assert e1.query()  # recorded earlier on the same stream
    assert torch.equal(dst, second)  # the later copy ran last
    stream.synchronize()
    stream.close()
    stream.close()


def test_wait_event_orders_later_work(table: EventTable) -> None:
    gate_line = Timeline(table, 1)  # another producer's stream, driven by hand
    gate = CpuEvent(table, 1, gate_line.issue())
    stream = make_copy_stream("cpu", table, 0)
    src, dst = _pattern(4096, 3), torch.zeros(4096, dtype=torch.uint8)
    stream.wait_event(gate)
    stream.copy(dst, src)
    done = stream.record()
    time.sleep(0.1)
    assert not done.query()
    assert int(dst.sum()) == 0  # nothing ran past the wait
    gate_line.signal(gate.value)
    assert done.wait(5.0)
    assert torch.equal(dst, src)
    stream.close()


def test_failed_stream_raises_and_never_signals(table: EventTable) -> None:
    never = CpuEvent(table, 1, 10**9)
    stream = CpuCopyStream(table, 0)
    stream.wait_event(never, timeout_s=0.05)
    dst = torch.zeros(16, dtype=torch.uint8)
    stream.copy(dst, torch.ones(16, dtype=torch.uint8))
    with pytest.raises(CopyStreamError, match="waited"):
        stream.synchronize()
    assert int(dst.sum()) == 0  # work after the failure was skipped
    with pytest.raises(CopyStreamError):
        stream.record()
    with pytest.raises(ValueError, match="shape"):
        stream.copy(torch.zeros(3), torch.zeros(4))  # rejected at submission
    stream.close()
    with pytest.raises(CopyStreamError, match="closed"):
        stream.copy(dst, dst)


def test_records_from_many_threads_signal_in_order(table: EventTable) -> None:
    stream = CpuCopyStream(table, 0)
    events: list[CpuEvent] = []

    def recorder() -> None:
        for _ in range(200):
            event = stream.record()
            assert isinstance(event, CpuEvent)
            events.append(event)

    threads = [threading.Thread(target=recorder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stream.synchronize()
    assert all(e.query() for e in events)
    assert table.read(0) == 800  # the last signal is the highest value
    assert stream.close(timeout_s=5.0)


def test_close_times_out_on_a_stuck_stream(table: EventTable) -> None:
    stream = CpuCopyStream(table, 0)
    stream.wait_event(CpuEvent(table, 1, 1), timeout_s=0.5)
    assert not stream.close(timeout_s=0.01)  # still waiting for the event
    assert stream.close(timeout_s=5.0)  # the wait timed out, the worker stopped


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    b = 100
    pairs = [(3 * b, 10 * b, b), (0, 7 * b, b), (b, 8 * b, b), (2 * b, 9 * b, b), (5 * b, 0, b)]
    assert coalesce(pairs) == [(0, 7 * b, 4 * b), (5 * b, 0, b)]
    assert coalesce([(0, 0, b), (b, 5 * b, b)]) == [(0, 0, b), (b, 5 * b, b)]
    assert coalesce([]) == []


def test_copy_blocks_between_regions(table: EventTable) -> None:
    block, num_blocks = 512, 64
    src_region = _pattern(block * num_blocks, 4)
    dst_region = torch.zeros(block * num_blocks, dtype=torch.uint8)
    rng = random.Random(5)
    # A run contiguous on both sides (coalesces into one copy), then random blocks.
    src_ids = [10, 11, 12, 13, *rng.sample([i for i in range(num_blocks) if not 10 <= i <= 13], 36)]
    dst_ids = [50, 51, 52, 53, *rng.sample([i for i in range(num_blocks) if not 50 <= i <= 53], 36)]
    pairs = [(s * block, d * block, block) for s, d in zip(src_ids, dst_ids, strict=True)]
    stream = CpuCopyStream(table, 0)
    count = copy_blocks(stream, src_region, dst_region, pairs)
    assert count < len(pairs)
    assert stream.record().wait(5.0)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(
            dst_region[d * block : (d + 1) * block], src_region[s * block : (s + 1) * block]
        )
    with pytest.raises(ValueError, match="outside"):
        copy_blocks(stream, src_region, dst_region, [(0, (num_blocks - 1) * block + 1, block)])
    stream.close()


@pytest.mark.parametrize(("chunk", "threads"), [(None, None), (1000, 1), (4096, 2), (1 << 30, 3)])
def test_copy_chunked_is_a_byte_copy(chunk: int | None, threads: int | None) -> None:
    src = torch.randn(25_000, dtype=torch.float32)
    dst = torch.zeros(100_000, dtype=torch.uint8)
    copy_chunked(dst, src, chunk, threads)
    assert torch.equal(dst.view(torch.float32), src)
    with pytest.raises(ValueError, match="mismatch"):
        copy_chunked(dst[:10], src)
    with pytest.raises(ValueError, match="contiguous"):
        copy_chunked(dst, src.view(250, 100).t())


def test_byte_copy_falls_back_for_non_contiguous() -> None:
    src = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    dst = torch.zeros(4, 3)
    byte_copy(dst, src)
    assert torch.equal(dst, src)
