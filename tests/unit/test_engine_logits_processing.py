"""The sampler's logits processing (vLLM's order and formulas), log-probabilities from the
raw logits, and the prefill's prompt log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from aegaeon_engine import LLM, Sampler, SamplingParams
from aegaeon_engine.sampling import RowState, process_logits, top_logprobs
from engine_support import make_checkpoint, prompts_of

VOCAB = 40


def _logits(rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_plain_rows_are_not_processed() -> None:
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1).processed
    for params in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={3: 1.0}),
                   SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=1),
                   SamplingParams(repetition_penalty=1.1), SamplingParams(grammar="x"),
                   SamplingParams(allowed_token_ids=(1,))):
        assert params.processed, params


@pytest.mark.parametrize(("field", "value"), [
    ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}),
    ("allowed_token_ids", (-1,)), ("min_tokens", -1), ("logprobs", 21), ("prompt_logprobs", -2),
])  # fmt: skip
def test_invalid_new_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_processing_matches_vllms_formulas() -> None:
    logits = _logits(1)[0]
    prompt, output = [1, 2, 3], [3, 4, 4, 5]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                       logit_bias={7: 2.5}, stop_token_ids=(9,), min_tokens=5)
    out = process_logits(logits[None], [p], [RowState(prompt, output)])[0]
    want = logits.clone()
    want[9] = -math.inf  # 4 generated < min_tokens: no stop token yet
    want[7] += 2.5
    for t in {*prompt, *output}:  # repetition: prompt and output tokens
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(output):  # frequency (count) and presence (once) on output tokens
        want[t] -= 0.25 * output.count(t) + 0.5
    assert torch.allclose(out, want)
    assert torch.equal(logits, _logits(1)[0])  # the caller's logits are left as they were


def test_min_tokens_stops_masking_once_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 10.0  # the stop token is the favourite
    p = SamplingParams(temperature=0, stop_token_ids=(9,), min_tokens=2)
    sampler = Sampler(seed=0)
    assert sampler.sample(logits, [p], [None], [RowState((), [5])])[0] != 9
    assert sampler.sample(logits, [p], [None], [RowState((), [5, 6])])[0] == 9


def test_allowed_ids_bias_and_min_p_restrict_draws() -> None:
    logits = _logits(1, seed=4)[0]
    sampler = Sampler(seed=2)
    allowed = SamplingParams(temperature=1.5, allowed_token_ids=(3, 11, 30))
    drawn = {sampler.sample(logits[None], [allowed], [None])[0] for _ in range(200)}
    assert drawn <= {3, 11, 30} and len(drawn) > 1
    biased = SamplingParams(temperature=0, logit_bias={17: 100.0})
    assert sampler.sample(logits[None], [biased], [None]) == [17]
    probs = (logits / 1.2).softmax(-1)
    keep = {int(i) for i in torch.nonzero(probs >= 0.2 * probs.max())}
    min_p = SamplingParams(temperature=1.2, min_p=0.2)
    drawn = {sampler.sample(logits[None], [min_p], [None])[0] for _ in range(300)}
    assert drawn <= keep and len(drawn) > 1


class _OnlyEven:
    """A grammar that allows even token ids."""

    def fill_bitmask(self, words: torch.Tensor) -> None:
        words.fill_(0x55555555)


def test_a_grammar_masks_only_its_row() -> None:
    logits = _logits(2, seed=5)
    p = SamplingParams(temperature=0, grammar="even")
    free = SamplingParams(temperature=0)
    out = Sampler(seed=0).sample(logits, [p, free], [None, None],
                                 [RowState(grammar=_OnlyEven()), RowState()])
    evens = logits[0].clone()
    evens[1::2] = -math.inf
    assert out == [int(evens.argmax()), int(logits[1].argmax())]


def test_top_logprobs_are_the_raw_log_softmax() -> None:
    logits = _logits(3, seed=6)
    chosen = [4, 0, 39]
    found = top_logprobs(logits, chosen, 5)
    logp = torch.log_softmax(logits, -1)
    for row, (token, got) in enumerate(zip(chosen, found, strict=True)):
        assert got.logprob == pytest.approx(float(logp[row, token]), abs=1e-6)
        order = logp[row].argsort(descending=True).tolist()
        assert got.top_ids == order[:5]
        assert got.top_logprobs == pytest.approx(logp[row, order[:5]].tolist(), abs=1e-6)
        assert got.rank == order.index(token) + 1


def test_prefill_scored_equals_the_full_logits(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = make_checkpoint(tmp_path_factory.mktemp("scored") / "m", "llama-gqa", seed=7)
    llm = LLM(path, dtype="float32")
    prompt = prompts_of((40,), seed=3)[0]
    blocks = list(range(llm.kv_shape.blocks_for(len(prompt))))
    last, scored = llm.engine.prefill_scored(prompt, blocks, 3)
    again = llm.engine.prefill(prompt, blocks)
    assert torch.allclose(last, again)
    assert len(scored) == len(prompt) - 1
    # each prefix's last logits, one prefill per prefix (the reference)
    for j in (0, 17, len(prompt) - 2):
        row = llm.engine.prefill(prompt[: j + 1], blocks)
        logp = torch.log_softmax(row, -1)
        assert scored[j].logprob == pytest.approx(float(logp[prompt[j + 1]]), abs=1e-4)
        assert scored[j].top_ids[0] == int(logp.argmax())
