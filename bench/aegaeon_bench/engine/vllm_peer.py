"""The engine-bench workload on vLLM's CPU build, as a worker any interpreter can run.

Imports only the standard library and vllm, so it runs in a scratch venv
(scripts/install-vllm) that never sees our packages. Protocol (JSON lines):
the first stdin line is the workload; the worker answers ``{"ready": true}``
once the model is loaded and warm, then runs one repeat per ``run`` line and
answers with that repeat's tokens/s; ``quit`` (or EOF) ends it. The bench
interleaves these repeats with ours so a noisy neighbour hurts every engine
alike.

What is measured (greedy, ``ignore_eos``, prefix caching off so repeats are
not free): prefill = each prompt alone with ``max_tokens=1``; decode at batch
B = ``B * (N - 1) / (t(max_tokens=N) - t(max_tokens=1))`` over the first B
prompts, i.e. the steady decode rate with vLLM's own scheduling overheads.

A workload without ``prompts`` is the switch bench's naive path instead
(``aegaeon_bench.switch.naive``): how vLLM switches models, one model per server,
so serving another means starting another engine. The worker builds the engine,
generates one token and answers ``{"first_token": id, "init_s": ...}`` as soon as
it has it, then ends; the parent times spawn -> that line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, TextIO


def main() -> int:
    # our JSON lines get the real stdout; anything vLLM prints goes to stderr
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    work = json.loads(sys.stdin.readline())
    scratch = tempfile.mkdtemp(prefix="aegaeon-vllm-")
    try:
        return _bench(work, scratch, protocol)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _bench(work: dict[str, Any], scratch: str, protocol: TextIO) -> int:
    threads = int(work["threads"])
    # vLLM writes caches and temp files; keep them in a scratch dir we remove
    for var, sub in (("VLLM_CACHE_ROOT", "cache"), ("TMPDIR", "tmp")):
        os.makedirs(os.path.join(scratch, sub), exist_ok=True)
        os.environ.setdefault(var, os.path.join(scratch, sub))
    tempfile.tempdir = None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the same cores as the bench process (vLLM's own default pins to cores too)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", work.get("cpus") or "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if "prompts" not in work:  # an engine start (module docstring)
        llm = LLM(model=work["model"], dtype=work["dtype"], seed=0, max_model_len=256,
                  max_num_seqs=8, enable_prefix_caching=False, skip_tokenizer_init=True)
        init_s = time.perf_counter() - started
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], params, use_tqdm=False)
        _send(protocol, {"first_token": int(out[0].outputs[0].token_ids[0]), "init_s": init_s})
        return 0
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
    _send(protocol, {"ready": True})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        seconds = sum(generate([p], 1)[0] for p in prompts)
        result: dict[str, Any] = {"prefill_tok_s": len(prompts) * len(prompts[0]) / seconds}
        for batch, key in ((1, "decode_tok_s_b1"), (len(prompts), "decode_tok_s_b8")):
            first, _ = generate(prompts[:batch], 1)
            full, tokens = generate(prompts[:batch], num_new)
            result[key] = batch * (num_new - 1) / max(full - first, 1e-9)
        result["tokens_b8"] = tokens
        _send(protocol, result)
    return 0


def _send(protocol: TextIO, message: dict[str, Any]) -> None:
    print(json.dumps(message), file=protocol, flush=True)


if __name__ == "__main__":
    sys.exit(main())
