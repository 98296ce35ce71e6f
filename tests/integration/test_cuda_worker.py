"""A worker on CUDA over a real cachemgr: pinned mappings, scale-ups, KV copies and events.

Marked `gpu` and skipped without CUDA. The rig is the switch bench's (a
cachemgr process, a decode worker built from a Config with ``device:
cuda``, this thread as its compute thread).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aegaeon_bench.switch.check import check_switches, greedy_tokens
from aegaeon_bench.switch.rig import Rig, RigSizes, switch_rig
from aegaeon_gpumem.cuda_copies import CudaCopyStream
from aegaeon_runtime.cacheclient.client import to_event
from cachemgr_harness import checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 1 << 20
SPIN_CYCLES = 200_000_000  # ~0.1-0.2 s of torch.cuda._sleep on current GPUs


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    return {"small": checkpoint(seed=1),
            "wide": checkpoint(seed=2, hidden=128, layers=3, intermediate=256)}


@pytest.fixture(scope="module")
def rig(models: dict[str, Path]) -> Iterator[Rig]:
    sizes = RigSizes(model_cache_bytes=64 * MiB, kv_cache_bytes=64 * MiB, slab_bytes=1 * MiB,
                     device_memory_bytes=96 * MiB, kv_memory_bytes=32 * MiB)
    with switch_rig(models, "bfloat16", sizes, device="cuda") as running:
        yield running


def test_mappings_are_page_locked(rig: Rig) -> None:
    worker = rig.worker
    assert worker.buffer.device.type == "cuda"
    assert worker.registration.kv_tensor.is_pinned()
    for name in worker.specs:
        mapped = worker.cache.load_model(name, pin=True)
        try:
            assert mapped.pinned in ("ro", "rw"), f"{name}: Model Cache region not pinned"
            assert mapped.data.is_pinned()
        finally:
            worker.cache.unpin(name)


def test_scale_up_copies_the_region_bytes(rig: Rig) -> None:
    switcher = rig.worker.switcher
    switcher.prefetch_enabled = False
    try:
        for name in ("small", "wide", "small"):
            switcher.activate(name)
            active = switcher.active
            assert active is not None and active.allocation is not None
            got = rig.worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
            mapped = rig.worker.cache.load_model(name, pin=True)
            try:
                assert torch.equal(got.cpu(), mapped.data)
            finally:
                rig.worker.cache.unpin(name)
    finally:
        switcher.prefetch_enabled = True


def test_switches_keep_the_greedy_tokens_of_a_fresh_engine(rig: Rig,
                                                           models: dict[str, Path]) -> None:
    check = check_switches(rig.worker, "small", "wide", models, "bfloat16")
    assert check.bytes_equal
    assert check.tokens_equal


def test_swap_out_starts_behind_the_callers_queued_work(rig: Rig) -> None:
    worker = rig.worker
    worker.switcher.activate("small")
    shape = worker.kv_shape("small")
    blocks = worker.kv.alloc(shape, 4)
    region = worker.buffer.kv_region
    torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
    for b in blocks:  # queued behind the sleep on the compute stream
        region[b * shape.block_bytes:(b + 1) * shape.block_bytes].fill_(0x5A)
    host, event = worker.kv.swap_out(shape, blocks)
    assert event.wait(30.0)
    host_region = worker.registration.kv_tensor
    for offset in host:
        assert bool((host_region[offset:offset + shape.block_bytes] == 0x5A).all())
    worker.kv.free_host(host, None)


def test_kv_round_trip_through_the_host_cache(rig: Rig) -> None:
    worker = rig.worker
    worker.switcher.activate("wide")
    shape = worker.kv_shape("wide")
    prompt = list(range(3, 40))
    expected = greedy_tokens(worker, prompt, 6)
    blocks = worker.kv.alloc(shape, shape.blocks_for(len(prompt) + 6))
    worker.engine.prefill(prompt, blocks)
    before = worker.engine.export_kv(blocks).cpu()
    host, out_event = worker.kv.swap_out(shape, blocks)
    again = worker.kv.alloc(shape, len(blocks))
    in_event = worker.kv.swap_in(shape, host, again, after=out_event)
    assert in_event.wait(30.0)
    assert torch.equal(worker.engine.export_kv(again).cpu(), before)
    worker.kv.free(shape, again)
    worker.kv.free_host(host, None)
    assert greedy_tokens(worker, prompt, 6) == expected


def test_cachemgr_defers_host_blocks_behind_a_cuda_event(rig: Rig) -> None:
    worker = rig.worker
    worker.switcher.activate("small")
    shape = worker.kv_shape("small")
    stream = worker.kv.swap_out_stream
    assert isinstance(stream, CudaCopyStream)
    with torch.cuda.stream(stream.torch_stream):
        torch.cuda._sleep(SPIN_CYCLES * 5)  # type: ignore[no-untyped-call]
    host, event = worker.kv.swap_out(shape, worker.kv.alloc(shape, 2))
    assert not event.query()
    # the cachemgr opens the CUDA IPC event (a CUDA context of its own) and holds the blocks
    freed = worker.cache.free_blocks(host, to_event(event.handle()))
    assert freed.num_deferred + freed.num_freed == len(host)
    assert event.wait(60.0)
    deadline = time.monotonic() + 30
    while worker.cache.stats().kv.move_list_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.cache.stats().kv.move_list_blocks == 0
