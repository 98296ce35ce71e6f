"""The engine-bench workload on vLLM's CPU build, run as a script by any interpreter.

Imports only the standard library and vllm, so it runs in a scratch venv
(scripts/install-vllm) that never sees our packages. Reads the workload as
JSON on stdin, prints one JSON line with tokens/s medians on stdout.

What is measured (greedy, ``ignore_eos``, prefix caching off so repeats are
not free): prefill = each prompt alone with ``max_tokens=1``; decode at batch
B = ``B * (N - 1) / (t(max_tokens=N) - t(max_tokens=1))`` over the first B
prompts, i.e. the steady decode rate with vLLM's own scheduling overheads.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def main() -> int:
    work = json.load(sys.stdin)
    threads = int(work["threads"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts: list[list[int]] = work["prompts"]
    num_new = int(work["num_new"])
    llm = LLM(model=work["model"], dtype=work["dtype"], seed=0,
              max_model_len=len(prompts[0]) + num_new + 16, max_num_seqs=len(prompts),
              enable_prefix_caching=False, skip_tokenizer_init=True)

    def generate(batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        inputs: Any = [TokensPrompt(prompt_token_ids=p) for p in batch]
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    generate(prompts, num_new)  # warm-up
    prefill: list[float] = []
    b1: list[float] = []
    b8: list[float] = []
    tokens: list[list[int]] = []
    for _ in range(int(work["repeats"])):
        seconds = sum(generate([p], 1)[0] for p in prompts)
        prefill.append(len(prompts) * len(prompts[0]) / seconds)
        for batch, sink in ((1, b1), (len(prompts), b8)):
            first, _ = generate(prompts[:batch], 1)
            full, tokens_now = generate(prompts[:batch], num_new)
            sink.append(batch * (num_new - 1) / max(full - first, 1e-9))
            if batch == len(prompts):
                tokens = tokens_now
    print(json.dumps({
        "prefill_tok_s": statistics.median(prefill), "decode_tok_s_b1": statistics.median(b1),
        "decode_tok_s_b8": statistics.median(b8), "tokens_b8": tokens,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
