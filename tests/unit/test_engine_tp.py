"""Tensor parallelism on the CPU: two real processes over gloo against one engine alone."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_engine import ModelSpec, fill_layout, weight_layout
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.tp import fill_shard, fill_tp_layout
from aegaeon_engine.tp_layout import TPLayout, check_tp, shard_spec, tp_layout
from aegaeon_engine.weights import bind_weights
from engine_support import VARIANTS, Bound, block_lists, make_checkpoint, prompts_of
from tp_support import run_group

NUM_TOKENS = 12
LENGTHS = (5, 19)  # the second crosses a block boundary
GREEDY = (*VARIANTS, "llama-bias")  # every market family, and a llama with biases
BF16 = ("llama-gqa", "qwen3")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-ckpts")
    out = {v: make_checkpoint(root / v, v, seed=10 + i) for i, v in enumerate(VARIANTS)}
    # q/k/v and o biases: the o bias lives on rank 0's shard alone
    out["llama-bias"] = make_checkpoint(root / "llama-bias", "llama-gqa", seed=20,
                                        attention_bias=True)
    return out


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@dataclass(frozen=True)
class GroupRun:
    """What one TP=2 group (two processes over gloo, started once per module: a
    process's start is most of a test's time) returned, beside the references."""

    greedy: dict[str, list[list[int]]]
    expected_greedy: dict[str, list[list[int]]]
    # per model: TP=2's bfloat16 logits, TP=1's float32 and bfloat16 ones
    bf16_logits: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    switch: dict[str, list[list[int]]]
    mirrored: dict[str, list[list[int]]]  # the switch driven by rank 0 (tp_mirror)
    expected_switch: dict[str, list[list[int]]]
    shm_leftover: set[str]


@pytest.fixture(scope="module")
def group_run(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    return _run(ckpts, tmp_path_factory.mktemp("tp-group"), "cpu")


@pytest.fixture(scope="module")
def nccl_run(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> GroupRun:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    return _run(ckpts, tmp_path_factory.mktemp("tp-nccl"), "cuda")


def _run(ckpts: dict[str, Path], work: Path, device: str) -> GroupRun:
    """The TP=2 group on ``device`` (``cuda``: NCCL over cuda:0 and cuda:1) against
    one engine on the CPU in float32 (CUDA's float32 matmuls are not TF32 here)."""
    prompts, blocks = prompts_of(LENGTHS, seed=5), block_lists(len(LENGTHS), 3)
    expected = {v: Bound(ckpts[v]).greedy(prompts, NUM_TOKENS, blocks) for v in GREEDY}
    jobs: list[dict[str, Any]] = [
        {"kind": "greedy", "model_dir": str(ckpts[v]), "prompts": prompts, "blocks": blocks,
         "num_tokens": NUM_TOKENS} for v in GREEDY]

    # the switch: a TP=2 llama whose shards come from a Model Cache file (each rank
    # copies its own range) and a single-device qwen3 on rank 0's device
    tp_dir, one_dir = ckpts["llama-gqa"], ckpts["qwen3"]
    tp_prompts, one_prompts = prompts_of(LENGTHS, seed=6), prompts_of((9,), seed=7)
    tp_blocks, one_blocks = block_lists(2, 3), block_lists(1, 3, shuffle_seed=1)
    expected_switch = {"tp": Bound(tp_dir).greedy(tp_prompts, NUM_TOKENS, tp_blocks),
                       "one": Bound(one_dir).greedy(one_prompts, NUM_TOKENS, one_blocks)}
    spec = ModelSpec.from_dir(tp_dir)
    layout = tp_layout(spec, 2, "float32")
    cache = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_tp_layout(tp_dir, spec, layout, cache)
    (work / "tp.cache").write_bytes(cache.numpy().tobytes())
    (work / "tp.cache.layout.json").write_text(layout.to_json())
    one_spec = ModelSpec.from_dir(one_dir)
    one_layout = weight_layout(one_spec, "float32")
    one = torch.empty(one_layout.total_bytes, dtype=torch.uint8)
    fill_layout(one_dir, one_layout, one)
    (work / "one.cache").write_bytes(one.numpy().tobytes())
    # bfloat16, the serving dtype: the partial sums are rounded before the reduce
    prompt, bf16_blocks = prompts_of((21,), seed=8)[0], block_lists(1, 2)[0]
    jobs += [{"kind": "logits", "model_dir": str(ckpts[v]), "dtype": "bfloat16",
              "prompt": prompt, "blocks": bf16_blocks} for v in BF16]
    references = {v: tuple(Bound(ckpts[v], dtype=d).engine.prefill(prompt, bf16_blocks)
                           for d in ("float32", "bfloat16")) for v in BF16}

    switch = {"kind": "switch", "tp_model_dir": str(tp_dir),
              "tp_cache": str(work / "tp.cache"), "one_model_dir": str(one_dir),
              "one_cache": str(work / "one.cache"), "tp_prompts": tp_prompts,
              "tp_blocks": tp_blocks, "one_prompts": one_prompts, "one_blocks": one_blocks,
              "num_tokens": NUM_TOKENS}
    jobs += [switch, {**switch, "mirror": True}]

    before = _shm_entries()
    results = run_group(2, jobs, work, device)
    leftover = {e for e in _shm_entries() - before if e.startswith(("torch", "gloo", "nccl"))}
    greedy, bf16 = results[:len(GREEDY)], results[len(GREEDY):len(GREEDY) + len(BF16)]
    spmd, mirrored = results[-2:]
    bf16_logits = {v: (torch.tensor(got), *references[v])
                   for v, got in zip(BF16, bf16, strict=True)}
    return GroupRun(dict(zip(GREEDY, greedy, strict=True)), expected, bf16_logits, spmd,
                    mirrored, expected_switch, leftover)


def test_tensor_parallel_greedy_equals_one_device(group_run: GroupRun) -> None:
    """TP=2 greedy tokens equal TP=1's in float32 for every family (llama with GQA and
    llama3 rope, mistral, qwen2 with one kv head replicated on both ranks and tied
    embeddings, qwen3 with q/k norm, a llama with q/k/v and o biases), the ranks
    loading only their shards; both
    processes ended cleanly and left nothing in /dev/shm."""
    assert group_run.greedy == group_run.expected_greedy
    assert not group_run.shm_leftover


def test_tensor_parallel_switch_keeps_both_models_tokens(group_run: GroupRun) -> None:
    """A TP=2 model decodes, rank 0 switches its weight buffer to a single-device model
    and back, and the TP model finishes its sequences from their KV: both models'
    tokens are their own; the same when rank 0 alone drives the group (TPDriver, the
    other rank mirroring its calls), as an instance's worker would."""
    assert group_run.switch == group_run.expected_switch
    assert group_run.mirrored == group_run.expected_switch


def test_tensor_parallel_bfloat16_within_one_devices_rounding(group_run: GroupRun) -> None:
    """In bfloat16 (the partial sums rounded before the reduce, as in vLLM) TP=2's
    logits are off float32's by at most twice what bfloat16 moves TP=1's."""
    for model, (tp2, f32, bf16) in group_run.bf16_logits.items():
        bound = 2 * (bf16 - f32).abs().max().item()
        error = (tp2 - f32).abs().max().item()
        assert error <= bound, f"{model}: TP=2 bfloat16 off float32 by {error}, bound {bound}"


@pytest.mark.gpu
def test_tensor_parallel_nccl_greedy_equals_one_device(nccl_run: GroupRun) -> None:
    """The same over NCCL on two CUDA devices (scripts/gpu-check's tensor_parallel step)."""
    assert nccl_run.greedy == nccl_run.expected_greedy
    assert not nccl_run.shm_leftover


@pytest.mark.gpu
def test_tensor_parallel_nccl_switch_keeps_both_models_tokens(nccl_run: GroupRun) -> None:
    assert nccl_run.switch == nccl_run.expected_switch
    assert nccl_run.mirrored == nccl_run.expected_switch


def test_tensor_parallel_shards_cover_the_model(ckpts: dict[str, Path]) -> None:
    """Every weight of the model is in exactly one shard (the replicated ones in each),
    each shard's range in the cache layout is its own, and a manifest round-trips."""
    spec = ModelSpec.from_dir(ckpts["llama-gqa"])
    layout = tp_layout(spec, 2, "float32")
    assert TPLayout.from_json(layout.to_json()) == layout
    (s0, e0), (s1, e1) = layout.shard_range(0), layout.shard_range(1)
    assert s0 == 0 and e0 <= s1 and e1 <= layout.total_bytes and s1 % 4096 == 0
    shards = []
    for rank in range(2):
        buf = torch.empty(layout.shards[rank].total_bytes, dtype=torch.uint8)
        fill_shard(ckpts["llama-gqa"], spec, layout, rank, buf)
        shards.append(buf)
    full = Bound(ckpts["llama-gqa"])
    w = bind_weights(spec, full.layout, full.weights)
    parts = [bind_weights(shard_spec(spec, r, 2), layout.shards[r], shards[r]) for r in (0, 1)]
    lw, l0, l1 = w.layers[0], parts[0].layers[0], parts[1].layers[0]
    torch.testing.assert_close(torch.cat((l0.o_proj, l1.o_proj), 1), lw.o_proj, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat((l0.down, l1.down), 1), lw.down, rtol=0, atol=0)
    q, kv = spec.q_size // 2, spec.kv_size // 2
    stacked = [torch.cat([p[a:b] for p in (l0.qkv, l1.qkv)]) for a, b in
               ((0, q), (q, q + kv), (q + kv, q + 2 * kv))]
    torch.testing.assert_close(torch.cat(stacked), lw.qkv, rtol=0, atol=0)
    torch.testing.assert_close(parts[1].embed_tokens, w.embed_tokens, rtol=0, atol=0)


def test_tensor_parallel_refuses_what_does_not_split(ckpts: dict[str, Path]) -> None:
    spec = ModelSpec.from_dir(ckpts["llama-gqa"])  # 4 heads, 2 kv heads, intermediate 160
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split into 3"):
        check_tp(spec, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=2 neither splits into 3"):
        check_tp(replace(spec, num_heads=6, intermediate_size=162), 3)
    broken = ckpts["mistral"].parent / "broken"
    broken.mkdir()
    for f in ckpts["mistral"].iterdir():
        (broken / f.name).symlink_to(f)
    (broken / "config.json").unlink()
    cfg = (ckpts["mistral"] / "config.json").read_text().replace('"hidden_size": 64',
                                                                 '"hidden_size": 32')
    (broken / "config.json").write_text(cfg)
    bad = ModelSpec.from_dir(broken)
    layout = tp_layout(bad, 2, "float32")
    with pytest.raises(CheckpointError, match="wrong shape"):
        fill_shard(broken, bad, layout, 1, torch.empty(layout.shards[1].total_bytes,
                                                       dtype=torch.uint8))
