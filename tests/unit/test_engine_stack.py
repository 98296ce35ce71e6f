"""A decode step's layers in one native call (kernels.py ``decode_layers``, csrc/stack.cpp):
the same kernels in the same order as model.forward's loop, so the logits are the
loop's bit for bit, for every family, dtype, kernel level and GGUF quantization."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from aegaeon_engine import DecodeSeq, Engine
from aegaeon_engine.llm import LLM
from aegaeon_engine.native import native_ops, supported_levels
from aegaeon_market.edit import add_model
from engine_support import VARIANTS, Bound, block_lists, make_checkpoint, prompts_of
from gguf import GGMLQuantizationType
from market_import_support import Tiny, hf_tensors, write_gguf

LEVELS = [lv for lv in supported_levels() if native_ops(lv) is not None]
pytestmark = pytest.mark.skipif(not LEVELS, reason="no native kernel level builds here")


def _steps(engine: Engine, prompts: list[list[int]], blocks: list[list[int]],
           fuse: bool) -> list[torch.Tensor]:
    """Prefill each prompt, then 4 ragged batched decode steps and one of batch 1."""
    engine.fuse_layers = fuse
    if fuse:  # the stack takes this batch (the loop otherwise: the same logits)
        assert engine._layer_stack(engine._model(), 1) is not None
    outs = [[int(engine.prefill(p, b).argmax())] for p, b in zip(prompts, blocks, strict=True)]
    logits = []
    for _ in range(4):
        seqs = [DecodeSeq(o[-1], len(p) + len(o) - 1, b)
                for p, o, b in zip(prompts, outs, blocks, strict=True)]
        step = engine.decode(seqs)
        logits.append(step)
        outs = [[*o, t] for o, t in zip(outs, step.argmax(-1).tolist(), strict=True)]
    first = prompts[0], outs[0], blocks[0]
    logits.append(engine.decode([DecodeSeq(first[1][-1], len(first[0]) + len(first[1]) - 1,
                                           first[2])]))
    return logits


def _assert_stack_equals_loop(engine: Callable[[], Engine], prompts: list[list[int]],
                              blocks: list[list[int]]) -> None:
    """The same steps on a fresh ``engine()`` each (a KV region of its own: both write the
    same slots), fused into one native call and layer by layer: the same logits, bit for bit."""
    fused, loop = (_steps(engine(), prompts, blocks, fuse) for fuse in (True, False))
    for got, want in zip(fused, loop, strict=True):
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("level", LEVELS)
def test_stack_equals_the_layer_loop(tmp_path: Path, variant: str, dtype: str,
                                     level: str) -> None:
    ckpt = make_checkpoint(tmp_path / variant, variant, seed=5)
    prompts, blocks = prompts_of((5, 17, 33), seed=2), block_lists(3, 6)
    _assert_stack_equals_loop(lambda: Bound(ckpt, dtype=dtype, engine=Engine(isa=level)).engine,
                              prompts, blocks)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_stack_runs_quantized_weights_as_the_loop_does(tmp_path: Path,
                                                       qtype: GGMLQuantizationType) -> None:
    tiny = Tiny(arch="qwen2", hidden=64, inter=128, layers=3)
    source = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(source, tiny, hf_tensors(tiny), qtype)
    entry = add_model(tmp_path / "market", source, "tiny", None, progress=False)
    assert entry.dtype == qtype.name.lower()  # kept quantized
    prompts, blocks = prompts_of((4, 19), seed=3, vocab=64), block_lists(2, 4)
    _assert_stack_equals_loop(lambda: LLM(entry.path).engine, prompts, blocks)


def test_the_loop_runs_where_the_stack_cannot(tmp_path: Path) -> None:
    """The torch path, and batches past the native projection's rows, take the loop."""
    ckpt = make_checkpoint(tmp_path / "q", "qwen3", seed=1)
    torch_path = Bound(ckpt, engine=Engine(native=False)).engine
    assert torch_path._layer_stack(torch_path._model(), 1) is None
    native = Bound(ckpt, engine=Engine(isa=LEVELS[0])).engine
    assert native._layer_stack(native._model(), 16) is not None
    assert native._layer_stack(native._model(), 17) is None
