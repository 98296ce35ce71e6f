"""A request's n sequences, log-probabilities and grammar state on the instances (the fake
worker of fake_worker.py for the loops, a real tokenizer for the grammar)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import pytest
import torch
from aegaeon_common.messages.prefill import EnqueuePrefill
from aegaeon_common.messages.report import PrefillDone, StepTokens
from aegaeon_common.messages.structs import SamplingParams
from aegaeon_runtime.decode.loop import DecodeLoop
from aegaeon_runtime.grammar import GrammarCache, ModelVocab
from aegaeon_runtime.prefill.loop import PrefillLoop
from aegaeon_sched import RoundController, RoundRobinPlanner
from fake_worker import FakeWorker, Outbox, latency_model, run_loop, token_at
from msgspec.structs import replace


def _decode(worker: FakeWorker, timed: list[tuple[float, Any]]) -> tuple[DecodeLoop, Outbox]:
    config = worker.config
    planner = RoundRobinPlanner(config.slo.tbt_s, config.scheduler.q_max_s,
                                ttft_s=config.slo.ttft_s)
    loop, outbox = run_loop(DecodeLoop, worker, timed, False, rounds=RoundController(planner))
    return loop, outbox


def _items(outbox: Outbox) -> dict[tuple[str, int], list[Any]]:
    out: dict[tuple[str, int], list[Any]] = {}
    for msg in outbox.of_type(StepTokens):
        for item in msg.items:
            out.setdefault((item.request_id, item.index), []).append(item)
    return out


def test_n_sequences_share_one_handoff_and_report_their_index() -> None:
    w = FakeWorker(latency_model(["a"]))
    base = w.enqueue("r", "a", 0, 20, 6, 0.0)
    first = token_at(19)
    msg = replace(base, sampling=replace(base.sampling, n=3, logprobs=2),
                  first_token_ids=[first, first, first], finished=[1])  # fmt: skip
    _, outbox = _decode(w, [(0.0, msg)])
    items = _items(outbox)
    assert set(items) == {("r", 0), ("r", 2)}  # sequence 1 ended with its first token
    for key in items:
        tokens = [t for item in items[key] for t in item.token_ids]
        assert tokens == [token_at(20 + k) for k in range(5)]  # 5 more after the first
        lps = [lp for item in items[key] for lp in item.logprobs]
        assert len(lps) == 5 and all(len(lp.top_ids) == 2 for lp in lps)
        assert [lp.top_ids[0] for lp in lps] == tokens  # greedy: the most likely each time
        assert items[key][-1].finish_reason == "length"
    # the shared handoff went back once, after both sequences swapped it in
    assert sorted(w.kv.host_freed) == sorted(base.handoff.block_offsets)
    w.kv.pool.reclaim()
    assert w.kv.device_bytes_used() == 0


def _prefill(worker: FakeWorker, msg: EnqueuePrefill) -> PrefillDone:
    _, outbox = run_loop(PrefillLoop, worker, [(0.0, msg)])
    (done,) = outbox.of_type(PrefillDone)
    return done


def test_a_prefill_samples_n_first_tokens_and_scores_the_prompt() -> None:
    prompt = list(range(30))
    spec = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, logprobs=1,
                        prompt_logprobs=2)  # fmt: skip
    done = _prefill(FakeWorker(latency_model(["a"]), kind="prefill"),
                    EnqueuePrefill("p", "a", 0, prompt, spec, 0.0))
    again = _prefill(FakeWorker(latency_model(["a"]), kind="prefill"),
                     EnqueuePrefill("p", "a", 0, prompt, spec, 0.0))
    firsts = [done.token_id, *done.sibling_token_ids]
    assert len(firsts) == 3 and len(set(firsts)) > 1  # each sequence draws its own
    assert firsts == [again.token_id, *again.sibling_token_ids]  # seeded: reproducible
    assert done.sibling_finish_reasons == [None, None]
    assert len(done.logprobs) == 3 and all(len(lp.top_ids) == 1 for lp in done.logprobs)
    assert len(done.prompt_logprobs) == len(prompt) - 1
    # the fake model predicts token_at(j) after position j
    assert [lp.top_ids[0] for lp in done.prompt_logprobs] == [token_at(j) for j in range(29)]
    assert done.handoff is not None  # one prefill, one KV copy for the three


@pytest.fixture(scope="module")
def vocab(proxy_market: Path) -> ModelVocab:
    import json

    model = proxy_market / "llama-gqa-5m"
    config = json.loads((model / "config.json").read_text())
    return ModelVocab(model / "tokenizer.json", config["vocab_size"], (config["vocab_size"] - 1,))


def test_a_grammar_state_rebuilt_from_the_tokens_so_far_masks_alike(vocab: ModelVocab) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(vocab.tokenizer_path))
    grammar = llguidance.LLMatcher.grammar_from_regex(r"(yes|no), (red|green|blue)")
    cache = GrammarCache(lambda m: vocab)
    words = (vocab.vocab_size + 31) // 32
    done = tokenizer.encode("yes, gr", add_special_tokens=False).ids
    walked = cache.state("m", grammar)
    walked.wait()
    for token in done:
        walked.accept(token)
    rebuilt = cache.state("m", grammar, done)  # a sequence that moved here with these tokens
    masks = []
    for state in (walked, rebuilt):
        assert state.check() == ""
        bits = torch.zeros(words, dtype=torch.int32)
        state.fill_bitmask(bits)
        masks.append(bits)
    assert torch.equal(masks[0], masks[1]) and int(masks[0].count_nonzero()) > 0
    allowed = [t for t in range(vocab.vocab_size) if masks[0][t // 32] >> (t % 32) & 1]
    assert all("een".startswith(tokenizer.decode([t]).strip()) or tokenizer.decode([t]) == ""
               for t in allowed)  # fmt: skip
    broken = cache.state("m", grammar, tokenizer.encode("maybe", add_special_tokens=False).ids)
    assert "do not follow the grammar" in broken.check()
    cache.close()
