"""The engine and the sampler on a device against the CPU's torch path (the reference).

Every test takes a ``device``: ``cuda`` (marked `gpu`, skipped without CUDA)
and ``cpu`` (the engine with its native kernels), so a test's own bugs show in
CI before a GPU is at hand. Float32 on both sides: the logits agree to
rounding (the device's kernels sum in another order), greedy tokens exactly;
bfloat16 must at least run and stay finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_engine import DecodeSeq, Engine, Sampler, SamplingParams
from aegaeon_engine.sampling import make_generator
from engine_support import VARIANTS, Bound, block_lists, greedy, make_checkpoint, prompts_of

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

LENGTHS = (5, 17, 33)  # crossing block boundaries (block size 16)
NUM_TOKENS = 16


class DeviceBound(Bound):
    """``Bound`` with its weights and KV region on ``device``, its own engine there."""

    def __init__(self, model_dir: Path, device: str, dtype: str = "float32") -> None:
        super().__init__(model_dir, engine=Engine("cpu", native=False), dtype=dtype)
        self.weights = self.weights.to(device)
        self.kv = self.kv.to(device)
        self.engine = Engine(device)
        self.bind()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-cuda-ckpts")
    return {v: make_checkpoint(root / v, v, seed=i) for i, v in enumerate(VARIANTS)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_logits_match_cpu(ckpts: dict[str, Path], variant: str,
                                              device: str) -> None:
    cpu = Bound(ckpts[variant], engine=Engine("cpu", native=False))
    gpu = DeviceBound(ckpts[variant], device)
    prompt = prompts_of([40], seed=2)[0]
    blocks = block_lists(1, 4)[0]
    ours = gpu.engine.prefill(prompt[:37], blocks)
    assert ours.device.type == device
    torch.testing.assert_close(ours.cpu(), cpu.engine.prefill(prompt[:37], blocks),
                               atol=1e-3, rtol=0)
    for pos in range(37, 40):
        step = [DecodeSeq(prompt[pos], pos, blocks)]
        torch.testing.assert_close(gpu.engine.decode(step)[0].cpu(),
                                   cpu.engine.decode(step)[0], atol=1e-3, rtol=0)


def test_batched_greedy_matches_cpu(ckpts: dict[str, Path], device: str) -> None:
    prompts = prompts_of(LENGTHS, seed=1)
    blocks = block_lists(3, 5)
    cpu = Bound(ckpts["qwen3"], engine=Engine("cpu", native=False))
    assert DeviceBound(ckpts["qwen3"], device).greedy(prompts, NUM_TOKENS, blocks) == cpu.greedy(
        prompts, NUM_TOKENS, blocks)


def test_chunked_prefill_equals_whole(ckpts: dict[str, Path], device: str) -> None:
    gpu = DeviceBound(ckpts["llama-gqa"], device)
    prompt = prompts_of([45], seed=4)[0]
    whole = gpu.engine.prefill(prompt, list(range(3)))
    gpu.engine.prefill(prompt[:20], list(range(3, 6)))
    chunked = gpu.engine.prefill(prompt[20:], list(range(3, 6)), start_pos=20)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


def test_bfloat16_batched_decode_runs(ckpts: dict[str, Path], device: str) -> None:
    gpu = DeviceBound(ckpts["mistral"], device, dtype="bfloat16")
    prompts = prompts_of(LENGTHS, seed=5)
    blocks = block_lists(3, 5)
    outs = greedy(gpu.engine, prompts, 9, blocks)
    logits = gpu.engine.decode([DecodeSeq(o[-1], len(p) + len(o) - 1, b)
                                for p, o, b in zip(prompts, outs, blocks, strict=True)])
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


def test_kv_export_moves_between_devices(ckpts: dict[str, Path], device: str) -> None:
    gpu = DeviceBound(ckpts["qwen2"], device)
    cpu = Bound(ckpts["qwen2"], engine=Engine("cpu", native=False))
    prompt = prompts_of([30], seed=6)[0]
    gpu.engine.prefill(prompt, [0, 1])
    cpu.engine.import_kv([2, 3], gpu.engine.export_kv([0, 1]).cpu())
    step_gpu = gpu.engine.decode([DecodeSeq(prompt[-1], 30, [0, 1])])[0].cpu()
    step_cpu = cpu.engine.decode([DecodeSeq(prompt[-1], 30, [2, 3])])[0]
    torch.testing.assert_close(step_gpu, step_cpu, atol=1e-3, rtol=0)


def test_sampler_is_seeded_and_respects_top_k(device: str) -> None:
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=0.8, top_k=5, seed=7),
              SamplingParams(temperature=1.0, top_p=0.5, seed=8),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2)]

    def draw() -> list[int]:
        gens = [make_generator(p, torch.device(device)) for p in params]
        return Sampler(device, seed=1).sample(logits, params, gens)

    first = draw()
    assert first == draw()
    assert first[0] in logits[0].topk(5).indices.tolist()
    assert first[2] == int(logits[2].argmax())


def test_attention_never_takes_the_cudnn_backend(ckpts: dict[str, Path], device: str) -> None:
    """cuDNN's SDPA compiles a kernel per new shape (NVRTC): a serving engine, whose
    shapes change every step, spent ~90% of its decode time compiling (H200 run)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = DeviceBound(ckpts["qwen2"], device, dtype="bfloat16")
    prompts = prompts_of(LENGTHS, seed=3)
    blocks = block_lists(len(prompts), 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for prompt, own in zip(prompts, blocks, strict=True):
            gpu.engine.prefill(prompt, own)
        for step in range(3):  # a new context length (and batch size) every step
            seqs = [DecodeSeq(p[-1], len(p) + step, b)
                    for p, b in zip(prompts[: step + 1], blocks[: step + 1], strict=True)]
            gpu.engine.decode(seqs)
    ops = {event.key for event in prof.key_averages()}
    assert not [op for op in ops if "cudnn_attention" in op], sorted(ops)
    assert any("scaled_dot_product" in op for op in ops)  # SDPA ran, on another backend


def _ops_of_one_step(engine: Engine, seqs: list[DecodeSeq]) -> int:
    """How many aten ops one decode step dispatches (each a kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:  # fmt: skip
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        engine.decode(seqs)
    return Count.ops


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-path"])
def test_a_decode_step_launches_per_layer_not_per_sequence(ckpts: dict[str, Path], device: str,
                                                           native: bool) -> None:  # fmt: skip
    """A decode step's host work is a fixed number of ops per layer, whatever the batch
    and the contexts: no loop over sequences or blocks. (On the H100 a 3B/8B model's eager
    b8 step took 29-48 ms against 4.5 ms for a 5-layer one: ~1 ms of launches per layer,
    28-32 layers; what a large model costs the next one is nothing but that.) With CUDA
    graphs a step is its inputs' copy and one replay."""
    if device != "cpu" and not native:
        pytest.skip("the device's engine has one path")
    gpu = DeviceBound(ckpts["qwen2"], device, dtype="bfloat16")
    if device == "cpu" and not native:
        gpu.engine = Engine("cpu", native=False)
        gpu.bind()
    prompts = prompts_of((5, 17, 33, 40, 9, 12, 47, 30), seed=7)
    blocks = block_lists(len(prompts), 4)
    for prompt, own in zip(prompts, blocks, strict=True):
        gpu.engine.prefill(prompt, own)

    def step(n: int, extra: int) -> list[DecodeSeq]:  # n sequences, `extra` tokens later
        return [DecodeSeq(p[-1], len(p) + extra, b)
                for p, b in zip(prompts[:n], blocks[:n], strict=True)]

    gpu.engine.decode(step(8, 0))  # a first step captures the CUDA graphs (on a GPU)
    counts = {(n, extra): _ops_of_one_step(gpu.engine, step(n, extra))
              for n in (2, 4, 8) for extra in (0, 12)}  # fmt: skip
    assert len(set(counts.values())) == 1, counts


class _Evens:
    """A grammar allowing even token ids (its bitmask is always filled on the CPU)."""

    def fill_bitmask(self, words: torch.Tensor) -> None:
        assert words.device.type == "cpu"
        words.fill_(0x55555555)


def test_processed_sampling_on_the_device_equals_the_cpu(device: str) -> None:
    """Token masks, penalties, bias and min_tokens where sampling happens, on either path."""
    from aegaeon_engine.sampling import RowState, process_logits, top_logprobs

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0, grammar="evens", logit_bias={4: 5.0}),
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, min_tokens=3, stop_token_ids=(7,)),
              SamplingParams(temperature=0, allowed_token_ids=(11, 500, 999))]
    states = [RowState(grammar=_Evens()), RowState([1, 2, 3], [3, 9, 9]), RowState()]
    on_cpu = process_logits(logits, params, states)
    on_device = process_logits(logits.to(device), params, states)
    assert torch.allclose(on_device.cpu(), on_cpu)
    tokens = Sampler(device).sample(logits.to(device), params, [None] * 3, states)
    assert tokens == Sampler("cpu").sample(logits, params, [None] * 3, states)
    assert tokens[0] % 2 == 0 and tokens[2] in (11, 500, 999)
    found = top_logprobs(logits.to(device), tokens, 4)
    want = top_logprobs(logits, tokens, 4)
    assert [f.top_ids for f in found] == [w.top_ids for w in want]
