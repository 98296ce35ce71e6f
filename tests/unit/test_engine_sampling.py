"""Sampling: validation, greedy equivalences, support restrictions, seeded determinism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aegaeon_engine import LLM, Sampler, SamplingParams
from aegaeon_engine.sampling import make_generator
from engine_support import make_checkpoint, prompts_of


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("top_k", 2.5), ("seed", -3), ("max_tokens", 0), ("max_tokens", True),
    ("stop_token_ids", (1, -2)), ("stop_token_ids", "ab"), ("ignore_eos", 1),
])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_stop_token_ids_accept_a_list() -> None:
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_equivalences() -> None:
    logits = _logits()
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler(seed=0)
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=1, seed=4),
                   SamplingParams(top_p=1e-9, seed=5), SamplingParams(temperature=0.7, top_p=1e-9)):
        gens = [make_generator(params, torch.device("cpu")) for _ in range(6)]
        assert sampler.sample(logits, [params] * 6, gens) == greedy, params
    mixed = [SamplingParams(temperature=0), SamplingParams(seed=1)] * 3
    out = sampler.sample(logits, mixed, [make_generator(p, torch.device("cpu")) for p in mixed])
    assert out[0::2] == greedy[0::2]


def test_top_k_and_top_p_restrict_support() -> None:
    logits = _logits(1, 40, seed=1)[0]
    order = logits.argsort(descending=True).tolist()
    sampler = Sampler(seed=1)
    params = SamplingParams(temperature=5.0, top_k=3)
    drawn = {t for _ in range(300) for t in sampler.sample(logits[None], [params], [None])}
    assert drawn <= set(order[:3]) and len(drawn) > 1
    probs = (logits / 4.0).softmax(-1)
    nucleus = int((probs[order].cumsum(0) < 0.6).sum()) + 1  # tokens needed to reach 0.6
    assert nucleus > 2
    params = SamplingParams(temperature=4.0, top_p=0.6)
    drawn = {t for _ in range(300) for t in sampler.sample(logits[None], [params], [None])}
    assert drawn <= set(order[:nucleus]) and len(drawn) > 1


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_tempered_distribution(seeded: bool) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -0.5])
    params = SamplingParams(temperature=0.8, top_k=5, seed=11 if seeded else None)
    probs = (logits / 0.8).masked_fill(logits == logits.min(), -torch.inf).softmax(-1)
    sampler = Sampler(seed=3)
    rows, steps = 500, 40
    gens = [make_generator(SamplingParams(seed=i), torch.device("cpu")) if seeded else None
            for i in range(rows)]  # fmt: skip
    counts = torch.zeros(6)
    for _ in range(steps):
        drawn = sampler.sample(logits.expand(rows, 6), [params] * rows, gens)
        counts += torch.bincount(torch.tensor(drawn), minlength=6)
    freq = counts / (rows * steps)
    assert freq[3] == 0  # cut by top_k: never drawn
    assert torch.allclose(freq, probs, atol=0.01), (freq, probs)


def test_seeded_rows_ignore_their_neighbours() -> None:
    logits = _logits(4, 64, seed=2)
    sampler = Sampler(seed=9)
    seeded = SamplingParams(seed=42)
    alone = [sampler.sample(logits[:1], [seeded], [make_generator(seeded, torch.device("cpu"))])
             for _ in range(1)]
    g = make_generator(seeded, torch.device("cpu"))
    others = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0)]
    gens = [g] + [make_generator(p, torch.device("cpu")) for p in others]
    batched = sampler.sample(logits, [seeded, *others], gens)
    assert batched[0] == alone[0][0]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_checkpoint(tmp_path_factory.mktemp("sampling") / "m", "llama-gqa", seed=3)
    return LLM(path, dtype="float32", seed=0)


def test_seeded_generation_is_independent_of_the_batch(llm: LLM) -> None:
    prompts = prompts_of((5, 12, 20), seed=1)
    seeded = SamplingParams(seed=123, max_tokens=20)
    alone = llm.generate([prompts[0]], seeded)[0]
    again = llm.generate([prompts[0]], seeded)[0]
    batched = llm.generate(prompts, [seeded, SamplingParams(max_tokens=20),
                                     SamplingParams(seed=5, max_tokens=9)])[0]
    other_seed = llm.generate([prompts[0]], SamplingParams(seed=124, max_tokens=20))[0]
    assert alone == again == batched
    assert other_seed != alone


def test_temperature_zero_and_top_k_one_equal_greedy(llm: LLM) -> None:
    prompts = prompts_of((7, 18), seed=2)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(top_k=1, seed=3, max_tokens=12, ignore_eos=True))
    tiny_p = llm.generate(prompts, SamplingParams(top_p=1e-9, max_tokens=12, ignore_eos=True))
    assert greedy == top1 == tiny_p


def test_max_tokens_stop_tokens_and_eos(llm: LLM, tmp_path: Path) -> None:
    prompt = prompts_of((9,), seed=4)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(full) == 12 and llm.finish_reasons == ["length"]
    stop = full[5]
    first = full.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                stop_token_ids=(stop,), ignore_eos=True))[0]
    assert out == full[:first + 1] and llm.finish_reasons == ["stop"]
    # the same token as the model's EOS (generation_config) stops unless ignore_eos
    eos_llm = LLM(_with_eos(llm, tmp_path, stop), dtype="float32")
    out = eos_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out == full[:first + 1] and eos_llm.finish_reasons == ["stop"]
    out = eos_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))[0]
    assert out == full


def _with_eos(llm: LLM, tmp_path: Path, eos: int) -> Path:
    import json
    import shutil

    root = tmp_path / "eos"
    shutil.copytree(llm.model_dir, root)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 250]}))
    return root
