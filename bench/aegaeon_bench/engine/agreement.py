"""Top-1 agreement of a model with a reference over the reference's own greedy text.

Teacher-forced: the reference decodes each prompt greedily; then both models read
the prompt and the reference's tokens (prefill, then one decode step per token) and
at every position the model's argmax is compared with the reference's token.
``top1_agreement`` is the share of positions that agree; ``logprob_drift`` the mean
absolute difference of the reference token's log-probability between the two,
``logprob_drift_p99`` and ``logprob_drift_max`` its 99th percentile and maximum.
Used for quantized weights (issue 27): ``aegaeon bench engine --reference``, the
real-model tests, and ``python -m aegaeon_bench.engine.agreement --model M --reference R``
over ``bench_prompts`` (the engine bench's fixed prompts: 8 x 128 seeded random
token ids), the last stdout line a JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from aegaeon_engine import SamplingParams
from aegaeon_engine.engine import DecodeSeq
from aegaeon_engine.llm import LLM


def teacher_forced(llm: LLM, prompt: list[int],
                   tokens: list[int]) -> tuple[list[int], list[float]]:
    """``llm``'s argmax and the log-probability of ``tokens[i]`` at each of their positions
    (``prompt`` prefilled, then one decode step per token)."""
    blocks = [llm.free_blocks.pop() for _ in range(-(-(len(prompt) + len(tokens))
                                                     // llm.engine.block_size))]
    try:
        logits = [llm.engine.prefill(prompt, blocks)]
        for i, token in enumerate(tokens[:-1]):
            logits.append(llm.engine.decode([DecodeSeq(token, len(prompt) + i, blocks)])[0])
    finally:
        llm.free_blocks.extend(reversed(blocks))
    rows = torch.stack(logits).float()
    logp = torch.log_softmax(rows, -1)
    index = torch.tensor(tokens)[:, None]
    return rows.argmax(-1).tolist(), logp.gather(1, index)[:, 0].tolist()


def top1_agreement(model: str | Path, reference: str | Path, prompts: Sequence[Sequence[int]],
                   num_new: int, dtype: str | None = None,
                   num_threads: int = 1) -> dict[str, Any]:
    """``model`` against ``reference`` over ``num_new`` greedy tokens of each prompt (see the
    module docstring), both served in ``dtype`` (default: each checkpoint's)."""
    ref = LLM(reference, dtype=dtype, num_threads=num_threads)
    greedy = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    texts = ref.generate([list(p) for p in prompts], greedy)
    ref_logp = [teacher_forced(ref, list(p), t)[1] for p, t in zip(prompts, texts, strict=True)]
    del ref
    cand = LLM(model, dtype=dtype, num_threads=num_threads)
    forced = [teacher_forced(cand, list(p), t) for p, t in zip(prompts, texts, strict=True)]
    return {**compare([f[0] for f in forced], [f[1] for f in forced], texts, ref_logp),
            "reference": str(reference)}


def compare(argmax: Sequence[Sequence[int]], logp: Sequence[Sequence[float]],
            ref_argmax: Sequence[Sequence[int]],
            ref_logp: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Top-1 agreement and log-probability drift of one engine against another, over every
    position (see the module docstring)."""
    agree = positions = 0
    drifts: list[float] = []
    for a, lp, ra, rlp in zip(argmax, logp, ref_argmax, ref_logp, strict=True):
        agree += sum(x == y for x, y in zip(a, ra, strict=True))
        positions += len(ra)
        drifts += [abs(x - y) for x, y in zip(lp, rlp, strict=True)]
    drift = torch.tensor(drifts, dtype=torch.float64)
    return {"top1_agreement": round(agree / positions, 4), "positions": positions,
            "logprob_drift": round(float(drift.mean()), 4),
            "logprob_drift_p99": round(float(drift.quantile(0.99)), 4),
            "logprob_drift_max": round(float(drift.max()), 4)}


def bench_prompts(vocab_size: int, num_prompts: int = 8, prompt_len: int = 128,
                  seed: int = 0) -> list[list[int]]:
    """The engine bench's prompts: seeded random token ids below ``vocab_size``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=gen).tolist()


def main(argv: Sequence[str] | None = None) -> int:
    """``--model`` against ``--reference`` over ``bench_prompts``; prints the JSON object."""
    from aegaeon_engine import ModelSpec

    parser = argparse.ArgumentParser(prog="python -m aegaeon_bench.engine.agreement",
                                     description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--reference", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", help="serve both in this dtype (default: each's own)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    vocab = ModelSpec.from_dir(args.reference).vocab_size
    prompts = bench_prompts(vocab, args.prompts, args.prompt_len, args.seed)
    result = top1_agreement(args.model, args.reference, prompts, args.new_tokens, args.dtype,
                            args.threads)
    print(json.dumps({**result, "model": str(args.model), "prompts": args.prompts,
                      "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                      "seed": args.seed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
