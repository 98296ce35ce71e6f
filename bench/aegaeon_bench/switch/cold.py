"""A cold worker, run as a script: what a request-level auto-scaler pays per switch.

A fresh process imports torch and the engine, builds the engine, loads the
weights of one checkpoint from disk into a new buffer (``aegaeon_engine.LLM``)
and produces a first token, then prints one JSON line with its own phase
times. The parent times spawn -> that line (interpreter start-up included).
Usage: ``python switch_cold.py MODEL_DIR DTYPE``.
"""

from __future__ import annotations

import json
import sys
import time

KV_CACHE_BYTES = 16 << 20  # one short request: the weights dominate


def main(argv: list[str]) -> int:
    """Load ``argv[0]`` in ``argv[1]`` and print the first token of a short prompt."""
    model_dir, dtype = argv
    start = time.perf_counter()
    import torch  # noqa: F401  (timed: a cold process pays for it)
    from aegaeon_engine import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, kv_cache_bytes=KV_CACHE_BYTES, max_num_seqs=1)
    loaded = time.perf_counter()
    token = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=1))[0][0]
    done = time.perf_counter()
    print(json.dumps({"first_token": token, "import_s": imported - start,
                      "load_s": loaded - imported, "first_token_s": done - loaded}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
