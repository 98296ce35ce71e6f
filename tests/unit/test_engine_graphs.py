"""The decode step's CUDA graph bookkeeping (aegaeon_engine.graphs) with a fake capturer,
and the engine's static step (what a graph replays) on the CPU.

The table decides which graph a step replays: one per (weight layout, address,
batch size), captured the first time a slot is bound and stepped, every size
at once, largest first; a model of another layout or at another address is
another slot and never replays a stale graph; a batch above the largest size,
or a failed capture, runs eager and says why; the first replay after a bind
waits on the copy's event. Then the real engine with the eager capturer (the
same static inputs and padding a CUDA graph reads) switches A -> B -> A over
one weights buffer and decodes the eager engine's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_engine import Engine, ModelSpec, load_weights, weight_layout
from aegaeon_engine.cuda_graphs import EagerCapturer, StaticInputs
from aegaeon_engine.graphs import (
    EAGER_BATCH,
    EAGER_CAPTURE_FAILED,
    CaptureError,
    GraphSlot,
    GraphTable,
)
from engine_support import block_lists, greedy, make_checkpoint, prompts_of


class FakeGraph:
    def __init__(self, capturer: FakeCapturer, run: Callable[[], Any]) -> None:
        self.capturer, self.run = capturer, run
        self.released = False

    def replay(self) -> Any:
        assert not self.released, "a released graph replayed"
        self.capturer.events.append("replay")
        return self.run()


class FakeCapturer:
    """Records captures, releases and waits; ``fail`` makes the next captures raise."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.fail = False

    def capture(self, run: Callable[[], Any]) -> FakeGraph:
        if self.fail:
            raise CaptureError("out of memory in the graph pool")
        self.events.append(f"capture {run()}")  # the fake's run says its size
        return FakeGraph(self, run)

    def release(self, graphs: Any) -> None:
        for g in graphs:
            g.released = True
        self.events.append(f"release {len(graphs)}")

    def wait(self, ready: object) -> None:
        self.events.append(f"wait {ready}")


def _runs(log: list[tuple[GraphSlot, int]], slot: GraphSlot) -> Callable[[int], Callable[[], int]]:
    def make_run(size: int) -> Callable[[], int]:
        def run() -> int:
            log.append((slot, size))
            return size
        return run
    return make_run


SLOT_A = GraphSlot(("llama", "bfloat16"), 0x1000)


def test_graph_sizes_round_up_and_a_larger_batch_runs_eager() -> None:
    table: GraphTable[int] = GraphTable(FakeCapturer(), sizes=(1, 2, 4, 8))
    assert [table.round_up(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    table.bind(SLOT_A)
    ran: list[tuple[GraphSlot, int]] = []
    assert table.replay(3, _runs(ran, SLOT_A)) == (4, 4)
    assert table.replay(9, _runs(ran, SLOT_A)) is None
    assert table.stats.eager_reasons == {EAGER_BATCH: 1}
    assert "batch of 9 above the largest captured size 8" in table.stats.last_eager_reason


def test_graph_slot_is_captured_once_largest_first_then_replayed() -> None:
    capturer = FakeCapturer()
    times = iter([10.0, 10.5])
    table: GraphTable[int] = GraphTable(capturer, sizes=(1, 2, 4), clock=lambda: next(times))
    table.bind(SLOT_A)
    ran: list[tuple[GraphSlot, int]] = []
    for batch in (1, 3, 2, 1):
        result = table.replay(batch, _runs(ran, SLOT_A))
        assert result is not None and result[0] >= batch
    assert [e for e in capturer.events if e.startswith("capture")] == [
        "capture 4", "capture 2", "capture 1"]
    assert capturer.events.count("replay") == 4
    stats = table.stats
    assert (stats.captures, stats.replays, stats.eager_steps) == (3, 4, 0)
    assert stats.capture_s == pytest.approx(0.5) and stats.slots == 1


def test_graph_of_another_layout_or_address_is_never_replayed() -> None:
    """A model of another layout at the same address, or the same layout moved, is a
    slot of its own: it captures its own graphs; coming back replays the first ones."""
    capturer = FakeCapturer()
    table: GraphTable[int] = GraphTable(capturer, sizes=(1, 2))
    ran: list[tuple[GraphSlot, int]] = []
    other_layout = GraphSlot(("qwen", "bfloat16"), SLOT_A.address)
    moved = GraphSlot(SLOT_A.layout, 0x9000)
    for slot in (SLOT_A, other_layout, moved, SLOT_A):
        table.bind(slot)
        ran.clear()
        assert table.replay(1, _runs(ran, slot)) == (1, 1)
        assert ran[-1] == (slot, 1)  # the replay ran this slot's step, no other
    assert table.stats.captures == 6  # three slots, two sizes each
    assert table.addresses(SLOT_A.layout) == [SLOT_A.address, moved.address]
    assert table.addresses(("mistral",)) == []


def test_graph_replay_after_a_bind_waits_on_the_copy_event_once() -> None:
    capturer = FakeCapturer()
    table: GraphTable[int] = GraphTable(capturer, sizes=(1,))
    ran: list[tuple[GraphSlot, int]] = []
    table.bind(SLOT_A, ready="copy-1")
    table.replay(1, _runs(ran, SLOT_A))
    table.replay(1, _runs(ran, SLOT_A))
    table.bind(SLOT_A, ready="copy-2")  # the model copied in again, into the same slot
    table.replay(1, _runs(ran, SLOT_A))
    assert capturer.events == ["capture 1", "wait copy-1", "replay", "replay", "wait copy-2",
                               "replay"]


def test_graph_capture_failure_runs_eager_says_why_and_is_not_retried() -> None:
    capturer = FakeCapturer()
    capturer.fail = True
    table: GraphTable[int] = GraphTable(capturer, sizes=(1, 2))
    table.bind(SLOT_A)
    ran: list[tuple[GraphSlot, int]] = []
    assert table.replay(1, _runs(ran, SLOT_A)) is None
    capturer.fail = False
    assert table.replay(1, _runs(ran, SLOT_A)) is None  # that slot stays eager
    assert table.stats.eager_reasons == {EAGER_CAPTURE_FAILED: 2}
    assert "out of memory in the graph pool" in table.stats.last_eager_reason
    moved = GraphSlot(SLOT_A.layout, 0x2000)
    table.bind(moved)
    assert table.replay(2, _runs(ran, moved)) == (2, 2)  # another slot captures


def test_graph_slots_beyond_the_limit_release_the_least_recently_used() -> None:
    capturer = FakeCapturer()
    table: GraphTable[int] = GraphTable(capturer, sizes=(1,), max_slots=2)
    slots = [GraphSlot(("m", i), 0x1000 * i) for i in range(3)]
    ran: list[tuple[GraphSlot, int]] = []
    for slot in (slots[0], slots[1], slots[0], slots[2]):
        table.bind(slot)
        table.replay(1, _runs(ran, slot))
    assert not table.has(slots[1]) and table.has(slots[0]) and table.has(slots[2])
    assert table.stats.evictions == 1 and "release 1" in capturer.events
    table.invalidate("the KV region moved")
    assert table.stats.slots == 0 and not table.has(slots[0])


def test_graph_static_inputs_pad_with_the_first_row() -> None:
    inputs = StaticInputs(rows=4, width=3, device=torch.device("cpu"))
    inputs.stage([7, 8], [15, 16], [[5], [6, 9]], block_size=16, size=4)
    tokens, positions, slot_blocks, slot_offsets, lens, table = inputs.views(4)
    assert tokens.tolist() == [7, 8, 7, 7] and positions.tolist() == [15, 16, 15, 15]
    assert slot_blocks.tolist() == [5, 9, 5, 5] and slot_offsets.tolist() == [15, 0, 15, 15]
    assert lens.tolist() == [16, 17, 16, 16] and table[:, 0].tolist() == [5, 6, 5, 5]
    inputs.stage_null(4)
    assert slot_blocks.tolist() == [-1] * 4 and lens.tolist() == [0] * 4
    with pytest.raises(ValueError, match="holds 3"):
        inputs.stage([1], [60], [[1, 2, 3, 4]], block_size=16, size=1)


def test_graph_stats_off_on_the_cpu_by_default() -> None:
    stats = Engine("cpu").graph_stats
    assert not stats.enabled and stats.disabled_reason


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("graph-models")
    return (make_checkpoint(root / "a", "llama-gqa", seed=1),
            make_checkpoint(root / "b", "qwen3", seed=2))


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_graph_switches_a_b_a_decode_the_eager_tokens(pair: tuple[Path, Path],
                                                      device: str) -> None:
    """One weights buffer, models copied in turn to offset 0 (as a scale-up does):
    each bind replays its own layout's graphs (A's again after B) and every turn's
    greedy tokens equal the eager engine's. The CPU runs the static step on the eager
    capturer; CUDA captures and replays CUDA graphs (Triton kernels) against the same
    kernels run eager."""
    specs = [ModelSpec.from_dir(p) for p in pair]
    packed = []
    for path, spec in zip(pair, specs, strict=True):
        data = torch.empty(weight_layout(spec, "float32").total_bytes, dtype=torch.uint8)
        load_weights(path, spec, weight_layout(spec, "float32"), data)
        packed.append(data)
    arena = torch.zeros(max(p.numel() for p in packed) + 64, dtype=torch.uint8, device=device)
    kv = torch.zeros(64 * max(s.kv_shape("float32").block_bytes for s in specs),
                     dtype=torch.uint8, device=device)
    on_cpu = device == "cpu"
    engine = (Engine("cpu", native=False, graphs=True, capturer=EagerCapturer()) if on_cpu
              else Engine(device, graphs=True))
    prompts = prompts_of((3, 16, 17, 30), seed=7)
    blocks = block_lists(4, 4)
    want = []
    for data, spec in zip(packed, specs, strict=True):
        eager = Engine("cpu", native=False) if on_cpu else Engine(device, graphs=False)
        eager.bind(spec, data.to(device), torch.zeros_like(kv), "float32")
        want.append(greedy(eager, prompts, 6, blocks))
    for turn, which in enumerate((0, 1, 0)):
        arena[:packed[which].numel()].copy_(packed[which])
        engine.bind(specs[which], arena[:packed[which].numel()], kv, "float32",
                    ready=f"copy-{turn}")
        assert greedy(engine, prompts, 6, blocks) == want[which], f"turn {turn}"
    stats = engine.graph_stats
    assert stats.enabled, stats.disabled_reason
    assert stats.slots == 2 and stats.captures == 2 * len(stats.sizes)  # A's reused
    assert stats.replays == 15 and stats.eager_steps == 0
    # a batch above the largest size runs eager, and says so
    seqs = [(prompts[i % 4][-1], len(prompts[i % 4]), blocks[i % 4]) for i in range(33)]
    from aegaeon_engine import DecodeSeq

    logits = engine.decode([DecodeSeq(*s) for s in seqs])
    assert logits.shape[0] == 33 and engine.graph_stats.eager_reasons == {EAGER_BATCH: 1}
