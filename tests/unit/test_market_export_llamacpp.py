"""llama.cpp runs the GGUF file our exporter writes as the same model our engine serves.

Needs llama.cpp (scripts/install-llamacpp); skipped without it. Each family's
tiny transformers-made checkpoint is written as a float32 GGUF file and run by
llama.cpp with a float32 KV cache and its plain attention (its CPU flash
attention rounds through float16): its greedy tokens equal ours, and its
logits differ from ours by under a hundredth of what bfloat16 alone changes in
the same model (the reference scale, measured here; a wrong row, rope or norm
would differ by the size of the logits themselves). Float32 against float32
they differ as much as ours and transformers do (~1e-6).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_bench.engine.peers import LLAMACPP_PYTHON
from aegaeon_market.gguf_export import write_gguf
from engine_support import Bound, make_checkpoint
from market_import_support import bpe, bpe_json

pytestmark = pytest.mark.skipif(not LLAMACPP_PYTHON.is_file(),
                                reason="llama.cpp not installed (scripts/install-llamacpp)")
STEPS = 6

# greedy decoding in llama.cpp: the logits of the prompt's last position and of each step
_GREEDY = r"""
import json, sys
import numpy as np
import llama_cpp as lc

work = json.load(sys.stdin)
lc.llama_backend_init()
model = lc.llama_model_load_from_file(work["gguf"].encode(), lc.llama_model_default_params())
params = lc.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch = 256, 64, 64
params.n_threads = params.n_threads_batch = 1
params.type_k = params.type_v = 0  # GGML_TYPE_F32: no float16 rounding of K and V
params.flash_attn_type = 0  # its CPU flash attention rounds to float16 on the way
ctx = lc.llama_init_from_model(model, params)
n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
batch = lc.llama_batch_init(64, 0, 1)

def decode(tokens, start):
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    assert lc.llama_decode(ctx, batch) == 0
    row = lc.llama_get_logits_ith(ctx, len(tokens) - 1)
    return np.ctypeslib.as_array(row, shape=(n_vocab,)).copy()

prompt = work["prompt"]
rows = [decode(prompt, 0)]
tokens = []
for step in range(work["steps"] - 1):
    tokens.append(int(rows[-1].argmax()))
    rows.append(decode([tokens[-1]], len(prompt) + step))
tokens.append(int(rows[-1].argmax()))
print(json.dumps({"tokens": tokens, "logits": [r.tolist() for r in rows]}))
"""


def _llama_cpp(gguf: Path, prompt: list[int]) -> dict[str, Any]:
    work = json.dumps({"gguf": str(gguf), "prompt": prompt, "steps": STEPS})
    out = subprocess.run([str(LLAMACPP_PYTHON), "-c", _GREEDY], input=work, text=True,
                         capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.splitlines()[-1]))


def _ours(model_dir: Path, prompt: list[int], dtype: str) -> tuple[list[int], torch.Tensor]:
    """Our greedy tokens and the logits of the prompt's last position and of each step."""
    from aegaeon_engine import DecodeSeq

    bound = Bound(model_dir, dtype=dtype)
    blocks = list(range(8))
    rows = [bound.engine.prefill(prompt, blocks).float()]
    tokens = [int(rows[-1].argmax())]
    for step in range(STEPS - 1):
        seq = DecodeSeq(tokens[-1], len(prompt) + step, blocks)
        rows.append(bound.engine.decode([seq])[0].float())
        tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows)


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral", "qwen2", "qwen3"])
def test_llama_cpp_greedy_and_logits_match_ours(tmp_path: Path, variant: str) -> None:
    tokens, _ = bpe()
    model_dir = make_checkpoint(tmp_path / variant, variant, vocab_size=len(tokens))
    (model_dir / "tokenizer.json").write_text(bpe_json())
    gguf = write_gguf(model_dir, tmp_path / f"{variant}.gguf", "float32")
    prompt = torch.randint(3, len(tokens), (24,), generator=torch.Generator().manual_seed(0))
    ids = prompt.tolist()
    theirs = _llama_cpp(gguf, ids)
    ours, ours_logits = _ours(model_dir, ids, "float32")
    _, bf16_logits = _ours(model_dir, ids, "bfloat16")
    llama_logits = torch.tensor(theirs["logits"])
    gap = (llama_logits - ours_logits).abs().max().item()
    scale = (bf16_logits - ours_logits).abs().max().item()  # what bfloat16 alone changes
    assert theirs["tokens"] == ours
    assert gap < scale / 100, (gap, scale)
