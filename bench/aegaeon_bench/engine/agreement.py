"""Top-1 agreement of a model with a reference over the reference's own greedy text.

Teacher-forced: the reference decodes each prompt greedily; then both models read
the prompt and the reference's tokens (prefill, then one decode step per token) and
at every position the model's argmax is compared with the reference's token.
``top1_agreement`` is the share of positions that agree; ``logprob_drift`` the mean
absolute difference of the reference token's log-probability between the two.
Used for quantized weights (issue 27): ``aegaeon bench engine --reference`` and
the real-model test.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from aegaeon_engine import SamplingParams
from aegaeon_engine.engine import DecodeSeq
from aegaeon_engine.llm import LLM


def _forced(llm: LLM, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """``llm``'s argmax and the log-probability of ``tokens[i]`` at each of their positions."""
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
    ref_logp = [_forced(ref, list(p), t)[1] for p, t in zip(prompts, texts, strict=True)]
    del ref
    cand = LLM(model, dtype=dtype, num_threads=num_threads)
    agree = positions = 0
    drift = 0.0
    for prompt, tokens, ref_lp in zip(prompts, texts, ref_logp, strict=True):
        argmax, logp = _forced(cand, list(prompt), tokens)
        agree += sum(a == t for a, t in zip(argmax, tokens, strict=True))
        positions += len(tokens)
        drift += sum(abs(a - b) for a, b in zip(logp, ref_lp, strict=True))
    return {"top1_agreement": round(agree / positions, 4), "positions": positions,
            "logprob_drift": round(drift / positions, 4), "reference": str(reference)}
