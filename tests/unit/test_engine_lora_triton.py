"""The LoRA term's Triton kernels (aegaeon_engine.gpu.lora) under the interpreter.

Without a GPU, ``TRITON_INTERPRET=1`` (tests/unit/conftest.py) runs them on the
CPU: each fused projection's term against the torch term of the same stack
(rows of the base, of every adapter, interleaved; ranks 8 to 64; modules
targeted by some adapters only), and greedy decodings (six tokens) on the kernels
against transformers + PEFT in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aegaeon_engine.lora import AdapterWeights, LoraStack, TritonLoraStep
from engine_support import make_checkpoint
from lora_support import ADAPTERS, PeftAdapter, make_peft_adapter, peft_greedy
from test_engine_lora import PROMPTS, Served
from triton_support import assert_close_dtype  # skips without the interpreter (or a GPU)

# greedy tokens on the kernels: each decode step launches every kernel again, which the
# interpreter runs in Python (test_engine_lora compares 12 on the torch path)
GREEDY_TOKENS = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lora-triton") / "base", "llama-gqa", seed=5)


@pytest.fixture(scope="module")
def adapters(base_dir: Path) -> list[PeftAdapter]:
    return [make_peft_adapter(base_dir, base_dir.parent / f"adapter-{rank}", rank, targets,
                              rslora, seed=20 + k)
            for k, (rank, targets, rslora) in enumerate(ADAPTERS)]


def _float32(adapter: AdapterWeights) -> AdapterWeights:
    """The same adapter with its (rounded) values in float32: the exact reference."""
    layers = tuple({m: (a.float(), b.float()) for m, (a, b) in layer.items()}
                   for layer in adapter.layers)
    return AdapterWeights(adapter.spec, torch.float32, layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_term_matches_torch(base_dir: Path, adapters: list[PeftAdapter],
                                   dtype: torch.dtype) -> None:
    """Each row's term in float32 arithmetic, rounded once into ``out``: against the term
    computed in float32 from the same (rounded) inputs."""
    name = str(dtype).split(".")[-1]
    served = Served(base_dir, adapters, dtype=name)
    a = served.adapters
    exact = [_float32(w) for w in a]
    pick = [1, None, 0, 2, 0, None, 2]
    kernels = LoraStack(a).step([None if k is None else a[k] for k in pick], triton=True)
    reference = LoraStack(exact).step([None if k is None else exact[k] for k in pick])
    assert isinstance(kernels, TritonLoraStep)
    widths = {"qkv": (64, 128), "o": (64, 64), "gate_up": (64, 320), "down": (160, 64)}
    for layer in range(2):
        for group, (inp, out) in widths.items():
            x = torch.randn(len(pick), inp).to(dtype)
            base = torch.randn(len(pick), out).to(dtype)
            got, want = base.clone(), base.float()
            kernels.add(layer, group, x, got)
            reference.add(layer, group, x.float(), want)
            assert_close_dtype(got, want.to(dtype), dtype)
            for n in (1, 5):  # the base's rows: untouched
                assert torch.equal(got[n], base[n])


def test_greedy_on_the_kernels_equals_peft(base_dir: Path, adapters: list[PeftAdapter]) -> None:
    served = Served(base_dir, adapters)
    served.engine.lora_stacks.kernels = "triton"
    rows = [(k, p) for p in PROMPTS[:1] for k in (0, None, 1, 2)]
    got = served.generate(rows, GREEDY_TOKENS)
    for k in (None, 0, 1, 2):
        want = peft_greedy(base_dir, None if k is None else adapters[k].path, PROMPTS[:1],
                           GREEDY_TOKENS)
        mine = [tokens for (kk, _), tokens in zip(rows, got, strict=True) if kk == k]
        assert mine == want, k
