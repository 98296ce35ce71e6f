"""LoRA adapters in the engine against PEFT (merge_and_unload), in float32.

Three adapters made by ``peft`` on a small Llama (ranks 8, 16 with rsLoRA, 64;
different target modules): each one's greedy decoding equals transformers + PEFT
token for token, alone and with all of them and the base in every decode step;
the adapter directory's defects are errors naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from aegaeon_engine import CheckpointError, ModelSpec
from aegaeon_engine.engine import DecodeSeq, Engine
from aegaeon_engine.lora import AdapterWeights, LoraStack, bind_adapter, fill_adapter
from aegaeon_engine.lora_spec import AdapterSpec, adapter_layout
from engine_support import make_checkpoint
from lora_support import ADAPTERS, PeftAdapter, make_peft_adapter, peft_greedy

NUM_TOKENS = 12
PROMPTS = [[1, 5, 9, 33, 2, 17], [7, 8, 100, 3], [4, 4, 4, 200, 31], [200, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lora") / "base", "llama-gqa", seed=3)


@pytest.fixture(scope="module")
def adapters(base_dir: Path) -> list[PeftAdapter]:
    return [make_peft_adapter(base_dir, base_dir.parent / f"adapter-{rank}", rank, targets,
                              rslora, seed=10 + k)
            for k, (rank, targets, rslora) in enumerate(ADAPTERS)]


@pytest.fixture(scope="module")
def references(base_dir: Path, adapters: list[PeftAdapter]) -> dict[int | None, list[list[int]]]:
    refs: dict[int | None, list[list[int]]] = {None: peft_greedy(base_dir, None, PROMPTS,
                                                                 NUM_TOKENS)}
    for k, adapter in enumerate(adapters):
        refs[k] = peft_greedy(base_dir, adapter.path, PROMPTS, NUM_TOKENS)
    return refs


class Served:
    """The base bound in an engine, with its adapters bound over their packed bytes."""

    def __init__(self, base_dir: Path, adapters: list[PeftAdapter], dtype: str = "float32",
                 native: bool = True, fuse: bool = True, device: str = "cpu") -> None:
        self.spec = ModelSpec.from_dir(base_dir)
        self.engine = Engine(device, native=native)
        self.engine.fuse_layers = fuse
        layout = self.engine.layout(self.spec, dtype)
        self.weights = torch.empty(layout.total_bytes, dtype=torch.uint8)
        from aegaeon_engine import load_weights

        load_weights(base_dir, self.spec, layout, self.weights)
        self.weights = self.weights.to(device)
        self.kv = torch.empty(64 * self.spec.kv_shape(dtype).block_bytes, dtype=torch.uint8,
                              device=device)
        self.engine.bind(self.spec, self.weights, self.kv, dtype)
        self.adapters = [load_adapter(a.path, self.spec, dtype, device) for a in adapters]
        self.free = list(range(64))

    def generate(self, rows: list[tuple[int | None, list[int]]],
                 num_tokens: int = NUM_TOKENS) -> list[list[int]]:  # fmt: skip
        """Greedy ``num_tokens`` for each (adapter index or None, prompt), every row in
        every decode step."""
        states = []
        for k, prompt in rows:
            blocks = [self.free.pop() for _ in range(2)]
            adapter = None if k is None else self.adapters[k]
            logits = self.engine.prefill(prompt, blocks, adapter=adapter)
            states.append((adapter, blocks, prompt, [int(logits.argmax())]))
        for _ in range(num_tokens - 1):
            seqs = [DecodeSeq(out[-1], len(prompt) + len(out) - 1, blocks, adapter)
                    for adapter, blocks, prompt, out in states]
            for (_, _, _, out), row in zip(states, self.engine.decode(seqs), strict=True):
                out.append(int(row.argmax()))
        for _, blocks, _, _ in states:
            self.free.extend(blocks)
        return [out for _, _, _, out in states]


def load_adapter(path: Path, base: ModelSpec, dtype: str, device: str = "cpu") -> AdapterWeights:
    spec = AdapterSpec.from_dir(path, base)
    layout = adapter_layout(spec, dtype)
    data = torch.empty(layout.total_bytes, dtype=torch.uint8)
    fill_adapter(path, spec, layout, data)
    return bind_adapter(spec, layout, data.to(device))


def test_adapter_spec_reads_what_peft_wrote(base_dir: Path, adapters: list[PeftAdapter]) -> None:
    base = ModelSpec.from_dir(base_dir)
    specs = [AdapterSpec.from_dir(a.path, base) for a in adapters]
    assert [s.rank for s in specs] == [8, 16, 64]
    assert specs[0].targets == ("q", "v")
    assert specs[1].targets == ("q", "k", "v", "o")
    assert specs[2].targets == ("o", "gate", "up", "down")
    assert specs[0].scale == pytest.approx(2.0)  # lora_alpha / r
    assert specs[1].scale == pytest.approx(32 / 4.0)  # rsLoRA: lora_alpha / sqrt(r)
    layout = adapter_layout(specs[0], "float32")
    # two layers, q (64 <- 64) and v (32 <- 64): A [8, 64] and B [out, 8] each
    assert layout.total_bytes == 2 * (2 * 8 * 64 + 8 * 64 + 8 * 32) * 4


@pytest.mark.parametrize(("native", "fuse"), [(True, True), (True, False), (False, False)],
                         ids=["native-stack", "native-layers", "torch"])
def test_each_adapter_alone_equals_peft_merged(base_dir: Path, adapters: list[PeftAdapter],
                                               references: dict[int | None, list[list[int]]],
                                               native: bool, fuse: bool) -> None:
    """On the CPU's native kernels (the fused stack of layers, or layer by layer: csrc/
    lora.cpp) and on torch's GEMMs (the masked stack, lora.LoraStep)."""
    served = Served(base_dir, adapters, native=native, fuse=fuse)
    for k in (None, 0, 1, 2):
        assert served.generate([(k, p) for p in PROMPTS]) == references[k], k
    assert references[0] != references[None]  # the adapters change what the model says
    assert len({str(r) for r in references.values()}) == 4


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_adapters_and_base_in_one_step_are_unchanged(
        base_dir: Path, adapters: list[PeftAdapter],
        references: dict[int | None, list[list[int]]], native: bool) -> None:
    served = Served(base_dir, adapters, native=native)
    rows = [(k, p) for p in PROMPTS for k in (2, None, 0, 1)]  # interleaved, not sorted
    got = served.generate(rows)
    for (k, prompt), tokens in zip(rows, got, strict=True):
        assert tokens == references[k][PROMPTS.index(prompt)], (k, prompt)
    assert served.engine.lora_stacks.num_builds == 1  # one stack served every step


def _merged_top_ids(base_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> list[int]:
    """transformers + PEFT (merged) in float32: the most likely next token at each of the
    prompt's positions but the last."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).merge_and_unload()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return [int(t) for t in logits.argmax(-1)]


def test_prompt_logprobs_run_the_adapter(base_dir: Path, adapters: list[PeftAdapter]) -> None:
    """``prefill_scored`` (prompt log-probabilities, vLLM's ``prompt_logprobs`` and
    completions' ``echo``) runs the adapter's term as ``prefill`` does: the same last
    logits, and at every prompt position the token PEFT's merged model ranks first."""
    served = Served(base_dir, adapters)
    prompt = PROMPTS[3]
    tops = {}
    for k in (None, 2):
        adapter = None if k is None else served.adapters[k]
        blocks = [served.free.pop() for _ in range(2)]
        last, scored = served.engine.prefill_scored(prompt, blocks, 3, adapter=adapter)
        assert torch.equal(last, served.engine.prefill(prompt, blocks, adapter=adapter))
        assert len(scored) == len(prompt) - 1 and all(len(s.top_ids) == 3 for s in scored)
        tops[k] = [s.top_ids[0] for s in scored]
        want = _merged_top_ids(base_dir, None if k is None else adapters[k].path, prompt)
        assert tops[k] == want, k
        served.free.extend(blocks)
    assert tops[None] != tops[2]  # the adapter's term is in the scores


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_adapter_and_all_at_once_equal_peft(
        base_dir: Path, adapters: list[PeftAdapter],
        references: dict[int | None, list[list[int]]]) -> None:
    """The CUDA engine with the Triton LoRA kernels (gpu/lora.py, compiled), float32."""
    served = Served(base_dir, adapters, device="cuda")
    rows = [(k, p) for p in PROMPTS for k in (2, None, 0, 1)]
    for (k, prompt), tokens in zip(rows, served.generate(rows), strict=True):
        assert tokens == references[k][PROMPTS.index(prompt)], (k, prompt)


def test_bfloat16_adapters_mixed_equal_each_alone(base_dir: Path,
                                                  adapters: list[PeftAdapter]) -> None:
    """In bfloat16 a row's term is computed on its own columns alone or mixed: the
    batch does not change what each row says."""
    served = Served(base_dir, adapters, dtype="bfloat16")
    alone = {k: served.generate([(k, p) for p in PROMPTS]) for k in (None, 0, 1, 2)}
    rows = [(k, p) for p in PROMPTS for k in (None, 0, 1, 2)]
    for (k, prompt), tokens in zip(rows, served.generate(rows), strict=True):
        assert tokens == alone[k][PROMPTS.index(prompt)], (k, prompt)


def test_stack_term_is_each_rows_own_adapter(base_dir: Path, adapters: list[PeftAdapter]) -> None:
    served = Served(base_dir, adapters)
    a = served.adapters
    rows = [a[1], None, a[0], a[2], a[0]]
    step = LoraStack(a).step(rows)
    x = torch.randn(len(rows), 64)
    out = torch.zeros(len(rows), 64 + 2 * 32)  # q | k | v
    step.add(0, "qkv", x, out)
    for n, adapter in enumerate(rows):
        want = torch.zeros(128)
        if adapter is not None:
            for module, (o0, o1) in (("q", (0, 64)), ("k", (64, 96)), ("v", (96, 128))):
                if module in adapter.spec.targets:
                    lora_a, lora_b = adapter.layers[0][module]
                    want[o0:o1] = adapter.spec.scale * (x[n] @ lora_a.T) @ lora_b.T
        torch.testing.assert_close(out[n], want, rtol=1e-5, atol=1e-5)


def _write(path: Path, doc: dict[str, object]) -> None:
    path.write_text(json.dumps(doc))


def test_adapter_defects_name_the_file_and_field(base_dir: Path, adapters: list[PeftAdapter],
                                                 tmp_path: Path) -> None:
    import shutil

    base = ModelSpec.from_dir(base_dir)
    good = adapters[0].path
    with pytest.raises(CheckpointError, match="missing"):
        AdapterSpec.from_dir(tmp_path / "nowhere", base)
    cases: dict[str, tuple[str, object]] = {
        "r": ("r", 128),
        "lora_alpha": ("lora_alpha", -1),
        "target_modules": ("target_modules", ["embed_tokens"]),
        "use_dora": ("use_dora", True),
    }
    for name, (key, value) in cases.items():
        bad = tmp_path / name
        shutil.copytree(good, bad)
        doc = json.loads((good / "adapter_config.json").read_text())
        doc[key] = value
        _write(bad / "adapter_config.json", doc)
        with pytest.raises(CheckpointError) as info:
            AdapterSpec.from_dir(bad, base)
        assert info.value.field == key and "adapter_config.json" in info.value.path, name
    missing = tmp_path / "no-weights"
    shutil.copytree(good, missing)
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors: missing file"):
        AdapterSpec.from_dir(missing, base)
    # an adapter of another base: its shapes do not fit
    other = ModelSpec.from_dir(make_checkpoint(tmp_path / "wide", "llama-gqa", hidden_size=96))
    with pytest.raises(CheckpointError, match="wrong shape") as info:
        AdapterSpec.from_dir(good, other)
    assert info.value.field is not None and "q_proj.lora_A" in info.value.field
