"""A vLLM engine start for one model, run as a script by the vLLM interpreter.

Imports only the standard library and vllm (it runs in the scratch venv of
scripts/install-vllm, which never sees our packages). This is how vLLM
switches models: one model per server, so serving another model means
starting another engine. Reads ``{"model", "dtype", "threads"}`` as JSON on
stdin, builds ``vllm.LLM``, generates one token and prints one JSON line
(``{"first_token": id, "init_s": ...}``) as soon as it has it; the parent
times spawn -> that line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any


def main() -> int:
    """Start vLLM on the model from stdin and print its first token (one JSON line)."""
    work = json.load(sys.stdin)
    scratch = tempfile.mkdtemp(prefix="aegaeon-vllm-")
    try:
        return _start(work, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _start(work: dict[str, Any], scratch: str) -> int:
    threads = int(work["threads"])
    # vLLM writes caches and temp files: keep them in a scratch dir we remove.
    for var, sub in (("VLLM_CACHE_ROOT", "cache"), ("TMPDIR", "tmp")):
        os.makedirs(os.path.join(scratch, sub), exist_ok=True)
        os.environ.setdefault(var, os.path.join(scratch, sub))
    tempfile.tempdir = None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=work["model"], dtype=work["dtype"], seed=0, max_model_len=256,
              max_num_seqs=8, enable_prefix_caching=False, skip_tokenizer_init=True)
    init_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    prompt: Any = TokensPrompt(prompt_token_ids=[1, 2, 3, 4])
    out = llm.generate([prompt], params, use_tqdm=False)
    print(json.dumps({"first_token": int(out[0].outputs[0].token_ids[0]), "init_s": init_s}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
