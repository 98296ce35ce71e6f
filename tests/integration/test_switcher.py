"""The worker's model switcher over a real cachemgr: placement, prefetch, cancel, tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from aegaeon_bench.switch.check import greedy_tokens
from aegaeon_bench.switch.rig import Rig, RigSizes, switch_rig

MiB = 1 << 20


@pytest.fixture(scope="module")
def rig(default_market: Path) -> Iterator[Rig]:
    names = ["llama-gqa-5m", "mistral-11m", "qwen2-19m"]
    models = {n: default_market / n for n in names}
    # An arena of ~1.5x the largest model: the placement has to use the gap below
    # the active model (and, when that is too small, promote it) to prefetch.
    sizes = RigSizes(
        model_cache_bytes=256 * MiB, kv_cache_bytes=64 * MiB, slab_bytes=4 * MiB,
        device_memory_bytes=(58 + 32) * MiB, kv_memory_bytes=32 * MiB,
    )  # fmt: skip
    with switch_rig(models, "bfloat16", sizes) as running:
        yield running


def _region_bytes(rig: Rig, name: str) -> torch.Tensor:
    mapped = rig.worker.cache.load_model(name, pin=True)
    data = mapped.data.clone()
    rig.worker.cache.unpin(name)
    return data


def test_activate_copies_exactly_the_model_cache_bytes(rig: Rig) -> None:
    switcher = rig.worker.switcher
    record = switcher.activate("qwen2-19m")
    assert record is not None and not record.prefetched
    active = switcher.active
    assert active is not None
    got = rig.worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
    assert torch.equal(got, _region_bytes(rig, "qwen2-19m"))
    assert switcher.activate("qwen2-19m") is None  # already active: no switch


def test_prefetched_switches_and_tokens_match_a_fresh_load(rig: Rig) -> None:
    switcher = rig.worker.switcher
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    switcher.activate("llama-gqa-5m")
    fresh = greedy_tokens(rig.worker, prompt, 12)
    order = ["mistral-11m", "qwen2-19m", "llama-gqa-5m", "qwen2-19m", "mistral-11m",
             "llama-gqa-5m"]  # fmt: skip
    moves = switcher.num_promotions + switcher.num_placed_below
    for name in order:
        assert switcher.prefetch(name)
        record = switcher.activate(name)
        assert record is not None and record.prefetched, name
        active = switcher.active
        assert active is not None
        view = rig.worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
        assert torch.equal(view, _region_bytes(rig, name))
    assert greedy_tokens(rig.worker, prompt, 12) == fresh
    # The small arena forced placements below the active model and promotions;
    # every prefetched model landed intact all the same (checked above).
    assert switcher.num_promotions + switcher.num_placed_below > moves


def test_activating_another_model_cancels_the_prefetch(rig: Rig) -> None:
    switcher = rig.worker.switcher
    switcher.activate("llama-gqa-5m")
    assert switcher.prefetch("qwen2-19m")
    record = switcher.activate("mistral-11m")  # not the prefetched one
    assert record is not None and not record.prefetched
    assert switcher.prefetched_model() is None
    active = switcher.active
    assert active is not None and active.name == "mistral-11m"
    view = rig.worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
    assert torch.equal(view, _region_bytes(rig, "mistral-11m"))


def test_a_sleeping_model_leaves_the_device_and_comes_back_intact(rig: Rig) -> None:
    """``SetModelAwake`` on an instance: sleep drops the active model and a prefetch of
    it (not while work of it is queued), wake switches it in when idle, else prefetches;
    its tokens after are a fresh load's."""
    from aegaeon_common.messages.prefill import SetModelAwake
    from aegaeon_runtime.models import set_awake

    w = rig.worker
    switcher = w.switcher
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    switcher.activate("llama-gqa-5m")
    fresh = greedy_tokens(rig.worker, prompt, 8)
    version = switcher.residency_version

    def sleep(name: str, busy: bool = False) -> list[str]:
        answer = set_awake(w, SetModelAwake(name, False, 7), lambda m: busy, idle=not busy)
        assert answer.ticket == 7 and answer.residency_version == switcher.residency_version
        return answer.resident_models

    assert sleep("llama-gqa-5m", busy=True) == ["llama-gqa-5m"]  # its work needs it
    assert sleep("llama-gqa-5m") == []
    assert switcher.active is None and switcher.residency_version > version
    assert sleep("llama-gqa-5m") == []  # asleep already: nothing changes
    awake = set_awake(w, SetModelAwake("llama-gqa-5m", True), lambda m: False, idle=True)
    assert awake.resident_models == ["llama-gqa-5m"]
    assert greedy_tokens(rig.worker, prompt, 8) == fresh
    # busy with another model: a wake prefetches it; a sleep cancels that prefetch
    awake = set_awake(w, SetModelAwake("mistral-11m", True), lambda m: True, idle=False)
    assert awake.resident_models == ["llama-gqa-5m", "mistral-11m"]
    assert sleep("mistral-11m") == ["llama-gqa-5m"]
    assert switcher.prefetched_model() is None
    assert greedy_tokens(rig.worker, prompt, 8) == fresh  # the active model was left alone
    # unknown names are ignored
    assert sleep("nope") == ["llama-gqa-5m"]


def test_two_models_that_fit_together_stop_being_copied(rig: Rig) -> None:
    """Two models alternating in an arena that holds both (static multiplexing, or two
    models sharing a decode instance): once each has been copied in, a prefetch finds its
    bytes where they still are and binds them (``resident``), no copy; a third model
    overwriting one of them makes it copied again. Tokens are a fresh load's."""
    switcher = rig.worker.switcher
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    switcher.activate("qwen2-19m")  # clear the arena of the others' bytes
    switcher.activate("llama-gqa-5m")
    fresh = greedy_tokens(rig.worker, prompt, 8)
    records = []
    for name in ["mistral-11m", "llama-gqa-5m"] * 3:
        assert switcher.prefetch(name)
        record = switcher.activate(name)
        assert record is not None and record.prefetched
        records.append(record)
        active = switcher.active
        assert active is not None and active.allocation is not None
        view = rig.worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
        assert torch.equal(view, _region_bytes(rig, name))
    # the first of each was copied (llama's from below the active model); then neither
    assert [r.resident for r in records] == [False, True, True, True, True, True]
    assert all(r.load_s == 0.0 for r in records[1:])
    assert greedy_tokens(rig.worker, prompt, 8) == fresh
    record = switcher.activate("qwen2-19m")  # overwrites them: copied again after
    assert record is not None and not record.resident
    record = switcher.activate("llama-gqa-5m")
    assert record is not None and not record.resident and record.load_s > 0
    assert greedy_tokens(rig.worker, prompt, 8) == fresh


def test_static_mux_keeps_both_models_without_prefetch(rig: Rig) -> None:
    """``keep_resident`` (static multiplexing): a scale-up that was not prefetched goes
    beside the active model, not over it, so two models that fit the arena alternate with
    no copy once each is in; without it (request-level) every switch copies."""
    switcher = rig.worker.switcher
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    switcher.activate("qwen2-19m")  # clear the arena of the others' bytes
    switcher.keep_resident = True
    try:
        records = [switcher.activate(name) for name in ["llama-gqa-5m", "mistral-11m"] * 3]
        assert all(r is not None and not r.prefetched for r in records)
        assert [r.resident for r in records if r is not None] == [False, False, True, True,
                                                                  True, True]  # fmt: skip
        fresh = greedy_tokens(rig.worker, prompt, 8)
        active = switcher.active
        assert active is not None and active.allocation is not None
        view = rig.worker.buffer.view(active.allocation.offset, active.allocation.nbytes)
        assert torch.equal(view, _region_bytes(rig, "mistral-11m"))
    finally:
        switcher.keep_resident = False
    # without it a scale-up goes to the arena's bottom, over what was there
    switcher.activate("llama-gqa-5m")
    record = switcher.activate("qwen2-19m")
    assert record is not None and not record.resident
    active = switcher.active
    assert active is not None and active.allocation is not None
    assert active.allocation.offset == 0
    record = switcher.activate("mistral-11m")
    assert record is not None and switcher.active is not None
    assert switcher.active.allocation is not None and switcher.active.allocation.offset == 0
    assert not record.resident  # qwen2-19m's copy went over it
    switcher.activate("mistral-11m")
    assert greedy_tokens(rig.worker, prompt, 8) == fresh
