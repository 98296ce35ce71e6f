"""The engine against transformers: greedy tokens, logits, batching, KV handoff, rebinding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_engine import DecodeSeq, Engine
from engine_support import (
    VARIANTS,
    Bound,
    block_lists,
    decode_step,
    greedy,
    hf_greedy,
    hf_last_logits,
    make_checkpoint,
    prompts_of,
)

LENGTHS = (5, 17, 33)  # crossing block boundaries (block size 16)
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-ckpts")
    return {v: make_checkpoint(root / v, v, seed=i) for i, v in enumerate(VARIANTS)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_greedy_equals_transformers(ckpts: dict[str, Path], variant: str) -> None:
    prompts = prompts_of(LENGTHS, seed=1)
    ours = Bound(ckpts[variant]).greedy(prompts, NUM_TOKENS, block_lists(3, 5))
    assert ours == hf_greedy(ckpts[variant], prompts, NUM_TOKENS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_within_1e_4(ckpts: dict[str, Path], variant: str) -> None:
    bound = Bound(ckpts[variant])
    prompt = prompts_of([40], seed=2)[0]
    blocks = block_lists(1, 4)[0]
    ours = bound.engine.prefill(prompt[:37], blocks)
    torch.testing.assert_close(ours, hf_last_logits(ckpts[variant], prompt[:37]),
                               atol=1e-4, rtol=0)
    # three decode steps feeding the prompt's own tokens: logits of every position
    for pos in range(37, 40):
        ours = bound.engine.decode([DecodeSeq(prompt[pos], pos, blocks)])[0]
        torch.testing.assert_close(ours, hf_last_logits(ckpts[variant], prompt[:pos + 1]),
                                   atol=1e-4, rtol=0)


def test_batched_decode_equals_decoding_alone(ckpts: dict[str, Path]) -> None:
    prompts = prompts_of((3, 16, 30, 47), seed=3)
    blocks = block_lists(4, 6)
    together = Bound(ckpts["qwen3"])
    alone = Bound(ckpts["qwen3"])
    pairs = zip(prompts, blocks, strict=True)
    outs = [[int(together.engine.prefill(p, b).argmax())] for p, b in pairs]
    for p, b in zip(prompts, blocks, strict=True):
        alone.engine.prefill(p, b)
    for _ in range(20):
        seqs = [DecodeSeq(o[-1], len(p) + len(o) - 1, b)
            for p, o, b in zip(prompts, outs, blocks, strict=True)]
        batched = together.engine.decode(seqs)
        singles = torch.cat([alone.engine.decode([s]) for s in seqs])
        torch.testing.assert_close(batched, singles, atol=1e-5, rtol=0)
        outs = [[*o, t] for o, t in zip(outs, batched.argmax(-1).tolist(), strict=True)]


def test_chunked_prefill_equals_whole(ckpts: dict[str, Path]) -> None:
    bound = Bound(ckpts["llama-gqa"])
    prompt = prompts_of([45], seed=4)[0]
    whole = bound.engine.prefill(prompt, [0, 1, 2])
    bound.engine.prefill(prompt[:20], [3, 4, 5])
    chunked = bound.engine.prefill(prompt[20:], [3, 4, 5], start_pos=20)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_kv_export_import_continues_identically(ckpts: dict[str, Path]) -> None:
    prompts = prompts_of((17, 33), seed=5)
    src = Bound(ckpts["mistral"], num_blocks=16)
    src_blocks = [[3, 7, 11, 2], [9, 0, 14, 5]]
    pairs = zip(prompts, src_blocks, strict=True)
    firsts = [[int(src.engine.prefill(p, b).argmax())] for p, b in pairs]
    # a second engine instance (its own region, its own copy of the weights)
    dst = Bound(ckpts["mistral"], num_blocks=40, engine=Engine())
    dst_blocks = [[30, 31, 12, 20], [1, 38, 6, 25]]
    for sb, db, p in zip(src_blocks, dst_blocks, prompts, strict=True):
        used = -(-len(p) // 16)
        dst.engine.import_kv(db[:used], src.engine.export_kv(sb[:used]))
    a, b = firsts, firsts
    for _ in range(NUM_TOKENS - 1):
        a = decode_step(src.engine, prompts, a, src_blocks)
        b = decode_step(dst.engine, prompts, b, dst_blocks)
    assert a == b
    assert a == hf_greedy(ckpts["mistral"], prompts, NUM_TOKENS)


def test_rebind_a_b_a_equals_fresh_engine(ckpts: dict[str, Path]) -> None:
    prompts = prompts_of((5, 17), seed=6)
    blocks = block_lists(2, 4)
    engine = Engine()
    a = Bound(ckpts["qwen2"], engine=engine)
    first = a.greedy(prompts, 16, blocks)
    b = Bound(ckpts["qwen3"], engine=engine)
    other = b.greedy(prompts, 16, blocks)
    a.bind()
    again = a.greedy(prompts, 16, blocks)
    fresh = Bound(ckpts["qwen2"]).greedy(prompts, 16, blocks)
    assert first == again == fresh
    assert other != first


def test_switch_is_a_flat_byte_copy(ckpts: dict[str, Path]) -> None:
    """Copying the packed bytes anywhere (as the Model Cache does) and binding serves the model."""
    prompts = prompts_of((9,), seed=7)
    src = Bound(ckpts["llama-gqa"])
    expect = src.greedy(prompts, 8, [[0]])
    arena = torch.zeros(src.layout.total_bytes + 4096, dtype=torch.uint8)
    arena[128:128 + src.layout.total_bytes].copy_(src.weights)
    engine = Engine()
    engine.bind(src.spec, arena[128:], src.kv, "float32")
    assert greedy(engine, prompts, 8, [[0]]) == expect


def test_window_is_enforced(ckpts: dict[str, Path]) -> None:
    bound = Bound(ckpts["qwen2"], num_blocks=20)
    window = bound.spec.max_model_len
    with pytest.raises(ValueError, match="window"):
        bound.engine.prefill([5] * (window + 1), list(range(20)))
    with pytest.raises(ValueError, match="window"):
        bound.engine.decode([DecodeSeq(5, window, list(range(20)))])
    with pytest.raises(ValueError, match="blocks"):
        bound.engine.prefill([5] * 20, [0])
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 20\)"):
        bound.engine.decode([DecodeSeq(5, 3, [20])])
    with pytest.raises(ValueError, match="block ids"):
        bound.engine.import_kv([99], bound.engine.export_kv([0]))


def test_market_variants_match_transformers(default_market: Path) -> None:
    """The smallest market model of each architecture, in float32, against transformers."""
    from aegaeon_market import load_market

    seen: dict[str, Any] = {}
    for entry in sorted(load_market(default_market), key=lambda e: e.params):
        seen.setdefault(entry.arch, entry)
    assert len(seen) == 4
    prompts = prompts_of(LENGTHS, seed=8, vocab=4000)
    for entry in seen.values():
        ours = Bound(Path(entry.path)).greedy(prompts, NUM_TOKENS, block_lists(3, 5))
        assert ours == hf_greedy(Path(entry.path), prompts, NUM_TOKENS), entry.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 200])  # the fused path and the plain one
def test_rms_norm_rounds_like_transformers(dtype: torch.dtype, rows: int) -> None:
    from aegaeon_engine.model import rms_norm

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 384, generator=g).to(dtype)
    w = torch.randn(384, generator=g).to(dtype)
    before = x.clone()
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert torch.equal(x, before)
    if dtype == torch.bfloat16 and rows == 3:  # the fused path: a rare last-bit difference
        assert (out != expect).float().mean() < 1e-3
        torch.testing.assert_close(out, expect, atol=0, rtol=2**-7)
    else:
        assert torch.equal(out, expect)
