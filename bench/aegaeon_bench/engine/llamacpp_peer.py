"""The engine-bench workload on llama.cpp (llama-cpp-python's low-level API), as a worker.

Imports only the standard library, numpy and llama_cpp, so it runs in the venv
scripts/install-llamacpp builds, which never sees our packages. The model is a
GGUF file the bench wrote from the same checkpoint in the same precision
(`aegaeon_market.gguf_export`). Protocol (JSON lines), as vllm_peer.py: the
first stdin line is the workload; the worker answers ``{"ready": true, ...}``
(llama.cpp's version, system info and context settings) once the model is
loaded and warm, then runs one repeat per ``run`` line and answers with that
repeat's tokens/s; ``quit`` (or EOF) ends it.

What is measured, as for ours (engine_runs.py), greedy (argmax of the float32
logits llama.cpp returns), ``n_threads`` = the bench's threads for both
single-token and batch evaluation:

- prefill: each prompt alone, one ``llama_decode`` of its tokens into an
  empty sequence (logits of the last token only);
- decode at batch 1: ``num_new - 1`` steps of the first prompt after its
  (untimed) prefill, one token per ``llama_decode``;
- decode at batch 8: the 8 prompts prefilled (untimed) into sequences 0..7,
  each with its own KV cells, then ``num_new - 1`` steps of one
  ``llama_decode`` holding 8 tokens, one per sequence (llama.cpp's batched
  decode, as its ``batched`` example and server do).

The context is llama.cpp's defaults but for its sizes: ``n_seq_max`` = 8
sequences, KV split per sequence (``kv_unified`` off, llama.cpp's advice when
sequences share no prefix), flash attention as llama.cpp decides (``auto``).

With ``forced`` in the workload (``aegaeon bench quant``: a list of ``[prompt,
tokens]``) a ``run`` instead reads each prompt and its tokens teacher-forced in
one sequence, as ours does: the prompt in one ``llama_decode``, then one
``llama_decode`` per token; at each of the tokens' positions it answers the
argmax and the log-probability of the token (log-softmax of llama.cpp's logits,
in float64). ``greedy`` (a list of ``[prompt, n]``) adds each prompt's ``n``
greedy tokens.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any, TextIO


class LlamaCpp:
    """One model and context; sequences are cleared before each use."""

    def __init__(self, work: dict[str, Any]) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.prompts: list[list[int]] = work["prompts"]
        self.num_new = int(work["num_new"])
        threads = int(work["threads"])
        count = int(work.get("sequences", len(self.prompts)))
        length = max(len(p) for p in self.prompts)  # the bench's are of one length
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(work["gguf"].encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {work['gguf']}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        per_seq = -(-(length + self.num_new + 1) // 256) * 256  # llama.cpp pads cells to 256
        params.n_ctx = count * per_seq
        params.n_batch = max(params.n_batch, length, count)
        params.n_ubatch = max(params.n_ubatch, length, count)  # a prompt in one ubatch
        params.n_seq_max = count
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(max(length, count), 0, 1)
        self.settings = {"n_ctx": lc.llama_n_ctx(self.ctx), "n_threads": threads,
                         "n_seq_max": count, "kv_unified": False,
                         "flash_attn": "auto", "n_ubatch": params.n_ubatch}

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants logits) items."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(items)
        code = self.lc.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, index: int) -> int:
        import numpy as np

        row = self.lc.llama_get_logits_ith(self.ctx, index)
        return int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def _prefill(self, seq: int, prompt: list[int]) -> int:
        self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        last = len(prompt) - 1
        self._decode([(t, p, seq, p == last) for p, t in enumerate(prompt)])
        return self._argmax(last)

    def _steps(self, firsts: list[int]) -> list[list[int]]:
        length = len(self.prompts[0])
        outs = [[t] for t in firsts]
        for step in range(self.num_new - 1):
            self._decode([(o[-1], length + step, s, True) for s, o in enumerate(outs)])
            for s, o in enumerate(outs):
                o.append(self._argmax(s))
        return outs

    def run(self) -> dict[str, Any]:
        """One repeat: tokens/s of prefill and decode at batch 1 and 8, the batch-8 tokens."""
        count, length, steps = len(self.prompts), len(self.prompts[0]), self.num_new - 1
        self.lc.llama_memory_clear(self.memory, True)
        start = time.perf_counter()
        for prompt in self.prompts:
            self._prefill(0, prompt)
        result: dict[str, Any] = {"prefill_tok_s": count * length / (time.perf_counter() - start)}
        for batch, key in ((1, "decode_tok_s_b1"), (count, "decode_tok_s_b8")):
            self.lc.llama_memory_clear(self.memory, True)
            firsts = [self._prefill(s, p) for s, p in enumerate(self.prompts[:batch])]
            start = time.perf_counter()
            tokens = self._steps(firsts)
            result[key] = batch * steps / (time.perf_counter() - start)
        result["tokens_b8"] = tokens
        return result

    def _row(self, index: int) -> Any:
        """The logits of batch item ``index`` as a float64 copy."""
        import numpy as np

        row = self.lc.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,)).astype(np.float64)

    def forced(self, prompt: list[int], tokens: list[int]) -> dict[str, list[Any]]:
        """``prompt`` then ``tokens`` teacher-forced: per token, the argmax of the logits
        that predict it and its log-probability."""
        import numpy as np

        rows = []
        self._prefill(0, prompt)
        rows.append(self._row(len(prompt) - 1))
        for k, token in enumerate(tokens[:-1]):
            self._decode([(token, len(prompt) + k, 0, True)])
            rows.append(self._row(0))
        logits = np.stack(rows)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return {"argmax": logits.argmax(-1).tolist(),
                "logprobs": logp[np.arange(len(tokens)), tokens].tolist()}

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        """``count`` greedy tokens after ``prompt`` (EOS taken like any token)."""
        out = [self._prefill(0, prompt)]
        while len(out) < count:
            self._decode([(out[-1], len(prompt) + len(out) - 1, 0, True)])
            out.append(self._argmax(0))
        return out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


_LOG_ERROR = 4  # ggml_log_level: GGML_LOG_LEVEL_ERROR
# what llama.cpp decided for itself, read from its log: flash attention (``auto``) and the KV cache
_NOTES = ("llama_context: flash_attn", "llama_kv_cache: size")
_FLASH = "graph: attention by FLASH_ATTN_EXT"


def _quiet_log(lc: Any, notes: list[str]) -> Any:
    """llama.cpp's log callback: errors to stderr, the lines of ``_NOTES`` into ``notes``,
    the rest dropped (the caller keeps the callback alive)."""
    def log(level: int, text: bytes, _data: Any) -> None:
        line = text.decode(errors="replace")
        if level == _LOG_ERROR:
            sys.stderr.write(line)
        elif line.startswith(_NOTES):
            notes.append(" ".join(line.split()))
        elif "(FLASH_ATTN_EXT)" in line and _FLASH not in notes:  # auto chose it
            notes.append(_FLASH)

    callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(log)
    lc.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


def main() -> int:
    # our JSON lines get the real stdout; anything llama.cpp prints goes to stderr
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    work = json.loads(sys.stdin.readline())
    import llama_cpp

    notes: list[str] = []
    keep = _quiet_log(llama_cpp, notes)
    forced = work.get("forced")
    if forced is not None:  # one sequence, as long as the longest prompt and its tokens
        work = {**work, "prompts": [p for p, _ in forced] + [p for p, _ in work["greedy"]],
                "num_new": max([len(t) for _, t in forced] + [n for _, n in work["greedy"]]),
                "sequences": 1}
    engine = LlamaCpp(work)
    try:
        if forced is None:
            engine.run()  # warm-up: buffers, the thread pool, repacked weights
        _send(protocol, {"ready": True, "version": llama_cpp.__version__,
                         "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                         **engine.settings, "log": notes})
        for line in sys.stdin:
            if line.strip() != "run":
                break
            _send(protocol, engine.run() if forced is None else {
                "forced": [engine.forced(p, t) for p, t in forced],
                "greedy": [engine.greedy(p, n) for p, n in work["greedy"]]})
    finally:
        engine.close()
        del keep
    return 0


def _send(protocol: TextIO, message: dict[str, Any]) -> None:
    print(json.dumps(message), file=protocol, flush=True)


if __name__ == "__main__":
    sys.exit(main())
