"""Bump arena and device buffer: property tests of allocation and the overlap-safe promote."""

from __future__ import annotations

import itertools

import pytest
import torch
from aegaeon_gpumem import (
    Allocation,
    BumpArena,
    DeviceBuffer,
    OutOfDeviceMemory,
    promote_copy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("alloc"), st.integers(0, 700), st.sampled_from([None, 1, 8, 64, 256, 1024])
        ),
        st.tuples(st.just("mark"), st.just(0), st.just(None)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(None)),
        st.tuples(st.just("reset"), st.just(0), st.just(None)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 4096), sequence=ops)
def test_bump_arena_invariants(capacity: int, sequence: list[tuple[str, int, int | None]]) -> None:
    arena = BumpArena(capacity)
    # The model: the pointer, live (non-empty) allocations in order, marks taken.
    top = 0
    live: list[Allocation] = []
    marks: list[int] = []
    for op, n, align in sequence:
        if op == "alloc":
            a = align or 256
            offset = -(-top // a) * a
            if offset + n > capacity:
                with pytest.raises(OutOfDeviceMemory) as info:
                    arena.alloc(n, align)
                assert info.value.requested_bytes == n
                assert info.value.capacity_bytes == capacity
                assert info.value.used_bytes == top
                assert str(capacity) in str(info.value) and str(n) in str(info.value)
            else:
                assert arena.alloc(n, align) == Allocation(offset, n)
                top = offset + n
                if n:
                    live.append(Allocation(offset, n))
        elif op == "mark":
            assert arena.mark() == top
            marks.append(top)
        elif op == "release" and marks:
            mark = marks[n % len(marks)]
            if mark <= top:
                arena.release_to(mark)
                top = mark
                live = [a for a in live if a.end <= mark]
                marks = [m for m in marks if m <= mark]
            else:
                with pytest.raises(ValueError):
                    arena.release_to(mark)
        elif op == "reset":
            arena.reset()
            top, live, marks = 0, [], []
        assert arena.allocations() == live
        assert arena.mark() == top
        stats = arena.stats()
        assert stats.used_bytes == top and stats.capacity_bytes == capacity
        assert stats.free_bytes == capacity - top
        assert top <= stats.peak_bytes <= capacity
        for prev, cur in itertools.pairwise(live):
            assert prev.end <= cur.offset  # disjoint, ordered
        arena.check_integrity()


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 3000),
    data=st.data(),
)
def test_promote_copy_is_overlap_safe(size: int, data: st.DataObject) -> None:
    buffer_bytes = 4096
    src = data.draw(st.integers(0, buffer_bytes - size))
    dst = data.draw(st.integers(0, src))
    seed = data.draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, 256, (buffer_bytes,), dtype=torch.uint8, generator=g)
    expected = buffer[src : src + size].clone()
    below = buffer[:dst].clone()
    copies = promote_copy(buffer, src, dst, size)
    assert torch.equal(buffer[dst : dst + size], expected)
    assert torch.equal(buffer[:dst], below)  # nothing below the destination is touched
    gap = src - dst
    assert copies == (0 if gap == 0 else -(-size // gap))


def test_promote_copy_rejects_upward_moves() -> None:
    buffer = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError):
        promote_copy(buffer, 10, 20, 5)
    with pytest.raises(ValueError):
        promote_copy(buffer, 90, 0, 20)


def test_device_buffer_layout_views_and_prefetch_promote() -> None:
    buf = DeviceBuffer(1 << 20, kv_bytes=256 << 10)
    assert buf.nbytes == 1 << 20 and buf.kv_bytes == 256 << 10
    assert buf.kv_offset == buf.weights_capacity == (1 << 20) - (256 << 10)
    assert buf.tensor.data_ptr() % 4096 == 0  # page-aligned base
    assert buf.kv_region.numel() == 256 << 10
    assert buf.kv_region.data_ptr() == buf.tensor.data_ptr() + buf.kv_offset
    # The active model, then a prefetched one right after it.
    active = buf.alloc(300_000)
    assert active.offset == 0
    prefetch = buf.alloc(200_000)
    assert prefetch.offset == -(-300_000 // 256) * 256
    pattern = torch.arange(200_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    buf.view(prefetch.offset, prefetch.nbytes).copy_(pattern)
    view = buf.view(prefetch.offset, 16)
    assert view.data_ptr() == buf.tensor.data_ptr() + prefetch.offset  # no copy
    moved = buf.promote(prefetch.offset, prefetch.nbytes)
    assert moved == Allocation(0, 200_000)
    assert torch.equal(buf.view(0, 200_000), pattern)
    assert buf.stats().used_bytes == 200_000 and buf.arena.allocations() == [moved]
    # The next prefetch goes right after the promoted model.
    assert buf.alloc(10).offset == -(-200_000 // 256) * 256
    with pytest.raises(OutOfDeviceMemory, match="requested"):
        buf.alloc(buf.weights_capacity)
    assert not buf.fits(buf.weights_capacity)
    with pytest.raises(ValueError):
        buf.view(buf.nbytes - 1, 2)
    with pytest.raises(ValueError):
        buf.promote(buf.weights_capacity - 10, 20)  # source reaches into the KV region
    buf.reset()
    assert buf.stats().used_bytes == 0 and buf.stats().peak_bytes >= 500_000


def test_device_buffer_over_existing_tensor_and_no_allocator_use() -> None:
    backing = torch.zeros(64 << 10, dtype=torch.uint8)
    buf = DeviceBuffer.over(backing, kv_bytes=16 << 10)
    assert buf.tensor.data_ptr() == backing.data_ptr()
    a = buf.alloc(1000, align=4096)
    buf.view(a.offset, a.nbytes).fill_(9)
    assert int(backing[999]) == 9
    with pytest.raises(ValueError):
        DeviceBuffer.over(torch.zeros(10, dtype=torch.float32))
    with pytest.raises(ValueError):
        DeviceBuffer(100, kv_bytes=200)


def test_alloc_at_a_chosen_place_above_the_pointer() -> None:
    """A switch copies a model where its CUDA graphs are (aegaeon_runtime.switcher)."""
    arena = BumpArena(1024)
    first = arena.alloc(100)
    at = arena.alloc_at(512, 256)
    assert at == Allocation(512, 256) and arena.top == 768
    assert arena.allocations() == [first, at]
    arena.check_integrity()
    with pytest.raises(ValueError, match="below the bump pointer"):
        arena.alloc_at(600, 10)
    with pytest.raises(OutOfDeviceMemory):
        arena.alloc_at(1000, 100)
    assert arena.top == 768
