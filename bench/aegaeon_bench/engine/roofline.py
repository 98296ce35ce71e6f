"""The roofline of ``aegaeon bench engine``: the core's limits, measured in the same run
(the matmul peak through torch's float32 and bfloat16 GEMMs, the read bandwidth of
a STREAM-like sum over a buffer far larger than the caches), a model's bytes and
FLOPs per token, and each engine's tokens/s held against both."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

GEMM_SIZES = (256, 512, 1024)  # 1024: 2.1 GFLOP, 10-100 ms on one core at full speed
GEMM_SECONDS = 0.1  # the largest size whose product takes at most this long
READ_BYTES = 256 << 20  # far past any last-level cache
REPEATS = 5


def _best(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """The shortest of ``repeats`` timed calls (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(dtype: Any) -> float:
    """GFLOP/s of torch's square GEMM in ``dtype`` at this process's threads and caps
    (``ATEN_CPU_CAPABILITY``, oneDNN's and MKL's ISA): the peak a prefill reaches. The
    largest of ``GEMM_SIZES`` that takes at most ``GEMM_SECONDS`` (an emulated bfloat16
    GEMM can be 100x slower than float32)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rate = 0.0
    for size in GEMM_SIZES:
        a = torch.randn(size, size, generator=g).to(dtype)
        b = torch.randn(size, size, generator=g).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        rate = max(rate, 2 * size ** 3 / _best(partial(torch.mm, a, b, out=out)))
        if 2 * (2 * size) ** 3 / rate > GEMM_SECONDS:
            break
    return round(rate / 1e9, 1)


def read_gb_s(nbytes: int = READ_BYTES) -> float:
    """GB/s of one pass summing a float32 buffer of ``nbytes`` (what a decode step that
    streams its weights can reach)."""
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds = _best(buffer.sum)
    return round(nbytes / seconds / 1e9, 2)


def machine_limits(dtype: str) -> dict[str, Any]:
    """``peak_gflops`` (the better of the float32 and ``dtype`` GEMM: what a prefill in
    ``dtype`` can reach, widened or not), ``peak_gflops_by_dtype`` and ``read_gb_s``."""
    import torch

    by_dtype = {name: matmul_gflops(getattr(torch, name))
                for name in dict.fromkeys(("float32", dtype))}
    return {"peak_gflops": max(by_dtype.values()), "peak_gflops_by_dtype": by_dtype,
            "read_gb_s": read_gb_s()}


def model_costs(spec: Any, dtype_bytes: int, prompt_len: int) -> dict[str, float]:
    """Per token of ``spec``: ``weight_bytes`` a decode step streams (every projection
    and the output layer, not the embedding rows it gathers), ``decode_flops`` (its
    multiply-adds, x2) and ``prefill_flops`` (the projections over a prompt of
    ``prompt_len`` plus causal attention, averaged per token; logits of the last
    position only)."""
    per_layer = (spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                 + spec.q_size * spec.hidden_size
                 + 3 * spec.hidden_size * spec.intermediate_size)
    layers = spec.num_layers * per_layer
    head = spec.vocab_size * spec.hidden_size
    # q.K and p.V over the positions before each token: (prompt_len + 1) / 2 on average
    attention = 4 * spec.num_layers * spec.q_size * (prompt_len + 1) / 2
    return {"weight_bytes": (layers + head) * dtype_bytes,
            "decode_flops": 2 * (layers + head),
            "prefill_flops": 2 * layers + attention + 2 * head / prompt_len}


def roofline(costs: dict[str, float], limits: dict[str, Any],
             tok_s: dict[str, float]) -> dict[str, float]:
    """An engine's tokens/s held against the machine: prefill GFLOP/s and its share of
    ``peak_gflops``, decode b1's GB/s of weights streamed and its share of
    ``read_gb_s``, decode b8's GFLOP/s and its share of the peak, b8 over b1."""
    prefill = tok_s["prefill_tok_s"] * costs["prefill_flops"] / 1e9
    b1_gb_s = tok_s["decode_tok_s_b1"] * costs["weight_bytes"] / 1e9
    b8 = tok_s["decode_tok_s_b8"] * costs["decode_flops"] / 1e9
    peak, read = limits["peak_gflops"], limits["read_gb_s"]
    return {"prefill_gflops": round(prefill, 1), "prefill_peak_share": round(prefill / peak, 3),
            "decode_b1_gb_s": round(b1_gb_s, 2), "decode_b1_read_share": round(b1_gb_s / read, 3),
            "decode_b8_gflops": round(b8, 1), "decode_b8_peak_share": round(b8 / peak, 3),
            "b8_over_b1": round(tok_s["decode_tok_s_b8"] / tok_s["decode_tok_s_b1"], 2)}
