"""The engine's Triton kernels (aegaeon_engine.gpu) under the interpreter, against torch.

The same kernels run on a GPU; here ``TRITON_INTERPRET=1`` (triton_support) runs
them on the CPU, each against a plain torch reference: paged decode attention
over several block sizes, head layouts (MHA, GQA 4:1 and 8:1) and mixed
context lengths (one token, exactly a block, one past it, several blocks, a
padding row of none), split and unsplit; RMSNorm with and without the residual
add; the q/k norm + rope + KV write; FP8 activation quantization and the FP8
GEMV. Then the engine on these kernels decodes the tokens the torch engine does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aegaeon_engine import fp8
from aegaeon_engine.gpu.fp8 import fp8_gemv, quantize_rows
from aegaeon_engine.gpu.norm import rms_norm as triton_rms_norm
from aegaeon_engine.gpu.paged_attention import num_splits_for, paged_decode
from aegaeon_engine.gpu.rope_write import rope_write as triton_rope_write
from aegaeon_engine.model import TORCH_OPS, KVViews, Tokens, rms_norm
from aegaeon_engine.rope import RopeTable
from aegaeon_engine.spec import RopeSpec
from triton_support import assert_close_dtype

DTYPES = [torch.float32, torch.bfloat16]


def _reference_attention(q: torch.Tensor, cache: torch.Tensor, layer: int,
                         tables: list[list[int]], lengths: list[int],
                         scale: float) -> torch.Tensor:
    """Each row's softmax(q K^T) V over its positions, K/V repeated per group, float32."""
    rows, num_q, dim = q.shape
    block_size, num_kv = cache.shape[3], cache.shape[4]
    out = torch.zeros(rows, num_q, dim)
    for r, n in enumerate(lengths):
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = torch.tensor(tables[r])[pos // block_size]
        k = cache[blocks, layer, 0, pos % block_size].float().repeat_interleave(
            num_q // num_kv, 1)
        v = cache[blocks, layer, 1, pos % block_size].float().repeat_interleave(
            num_q // num_kv, 1)
        weights = (torch.einsum("hd,nhd->hn", q[r].float(), k) * scale).softmax(-1)
        out[r] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_q", "num_kv"), [(4, 4), (8, 2), (8, 1)],
                         ids=["mha", "gqa4", "gqa8"])
def test_triton_paged_decode_matches_torch(block_size: int, num_q: int, num_kv: int) -> None:
    torch.manual_seed(block_size + num_q + num_kv)
    dim, layers, num_blocks = 16, 2, 24
    # one token, exactly a block, one past a block, several blocks, a padding row of none
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 0]
    width = -(-max(lengths) // block_size)
    ids = torch.randperm(num_blocks).tolist()
    tables = [ids[i * width:(i + 1) * width] for i in range(len(lengths))]
    splits = 1 if block_size == 16 else 4  # unsplit and flash-decoding's combine
    for dtype in DTYPES:
        cache = torch.randn(num_blocks, layers, 2, block_size, num_kv, dim).to(dtype)
        qkv = torch.randn(len(lengths), num_q + 2 * num_kv, dim).to(dtype)
        q = qkv[:, :num_q]  # a strided view, as the engine passes it
        out = torch.full((len(lengths), num_q, dim), float("nan"), dtype=dtype)
        paged_decode(out, q, cache, 1, torch.tensor(tables, dtype=torch.int32),
                     torch.tensor(lengths, dtype=torch.int32), dim ** -0.5, splits)
        want = _reference_attention(q, cache, 1, tables, lengths, dim ** -0.5)
        assert_close_dtype(out, want, dtype)
        assert torch.equal(out[-1].float(), torch.zeros(num_q, dim))  # context 0: zeros


def test_triton_paged_decode_one_table_for_every_row() -> None:
    """A prefill chunk's tokens share one block table (row stride 0), each row its own
    context: the positions up to its own."""
    torch.manual_seed(5)
    cache = torch.randn(6, 1, 2, 16, 2, 16)
    table = torch.tensor([[4, 1, 3]], dtype=torch.int64).expand(5, -1)
    lengths = [30, 31, 32, 33, 34]
    q = torch.randn(5, 4, 16)
    out = torch.empty(5, 4, 16)
    paged_decode(out, q, cache, 0, table, torch.tensor(lengths), 0.25, 2)
    want = _reference_attention(q, cache, 0, [[4, 1, 3]] * 5, lengths, 0.25)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_triton_paged_decode_splits_fill_a_gpu_by_batch_size() -> None:
    assert num_splits_for(1, 8) == 16 and num_splits_for(32, 8) == 1
    assert all(s & (s - 1) == 0 for s in (num_splits_for(b, 2) for b in range(1, 40)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rms_norm_with_and_without_the_residual_add(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    res = torch.randn(5, 96).to(dtype)
    assert_close_dtype(triton_rms_norm(x, weight, 1e-6), rms_norm(x.clone(), weight, 1e-6),
                       dtype)
    assert_close_dtype(triton_rms_norm(x, None, 1e-5), rms_norm(x.clone(), None, 1e-5), dtype)
    h = x.clone()
    normed = triton_rms_norm(h, weight, 1e-6, residual=res)
    want_h = x + res
    assert_close_dtype(h, want_h, dtype)  # the residual stream, updated in place
    assert_close_dtype(normed, rms_norm(want_h.clone(), weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm"])
def test_triton_rope_write_matches_torch(dtype: torch.dtype, qk_norm: bool) -> None:
    torch.manual_seed(2)
    num_q, num_kv, dim, n, block_size, layers = 4, 2, 32, 5, 16, 2
    rope = RopeTable(dim, RopeSpec(theta=10000.0), 256, dtype, torch.device("cpu"))
    table = rope.ensure(256)
    positions = torch.tensor([0, 15, 16, 100, 7])
    slot_blocks = torch.tensor([3, 0, 1, 2, 5])
    slot_offsets = positions % block_size
    norms = (torch.randn(dim).to(dtype), torch.randn(dim).to(dtype)) if qk_norm else (None,
                                                                                     None)
    qkv = torch.randn(n, num_q + 2 * num_kv, dim).to(dtype)
    block_bytes = layers * 2 * block_size * num_kv * dim * dtype.itemsize

    def run(triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = qkv.clone()
        region = torch.zeros(6 * block_bytes, dtype=torch.uint8)
        cache = region.view(dtype).view(6, layers, 2, block_size, num_kv, dim)
        if triton:
            triton_rope_write(x, norms[0], norms[1], table, positions, cache, 1, slot_blocks,
                              slot_offsets, num_q, 1e-6)
        else:
            kv = KVViews(cache, tuple(cache[:, i].transpose(1, 2) for i in range(layers)),
                         region.view(6, -1), cache.view(6 * layers * 2, -1),
                         torch.arange(layers * 2).view(layers, 2, 1))
            rows = table.index_select(1, positions)[:, :, None]
            lw = type("LW", (), {"q_norm": norms[0], "k_norm": norms[1]})()
            TORCH_OPS.rope_write(x, lw, kv, 1, Tokens(x[:, 0, 0], rows[0], rows[1], slot_blocks,
                                                     slot_offsets), num_q, 1e-6)
        return x, cache

    got, got_cache = run(triton=True)
    want, want_cache = run(triton=False)
    # four roundings in a row with a q/k norm (normed, times its weight, two products, sum)
    ulps = 4 if qk_norm else 2
    assert_close_dtype(got, want, dtype, ulps=ulps)
    assert_close_dtype(got_cache, want_cache, dtype, ulps=ulps)
    assert not got_cache[:, 0].any() and not got_cache[4].any()  # other layers, blocks


def test_triton_rope_write_of_a_negative_block_writes_no_kv() -> None:
    """A graph capture's warm-up rows (slot block -1) must leave the KV region alone."""
    table = RopeTable(16, RopeSpec(theta=10000.0), 64, torch.float32,
                      torch.device("cpu")).ensure(64)
    cache = torch.zeros(2, 1, 2, 16, 1, 16)
    qkv = torch.randn(3, 4, 16)
    triton_rope_write(qkv, None, None, table, torch.zeros(3, dtype=torch.int32), cache, 0,
                      torch.full((3,), -1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                      2, 1e-6)
    assert not cache.any()


def test_triton_fp8_quantize_rows_as_the_torch_path() -> None:
    torch.manual_seed(3)
    x = (torch.randn(4, 1500) * 3).bfloat16()
    x[2] = 0  # an all-zero row: the smallest scale, zero codes
    codes, scale = quantize_rows(x)
    xf = x.float()
    want_scale = xf.abs().amax(1, keepdim=True).div(448.0).clamp(min=1e-12)
    assert torch.equal(scale, want_scale)
    exact = (xf / want_scale).clamp(-448, 448)
    want = exact.to(torch.float8_e4m3fn).float()
    got = codes.float()
    # The interpreter's e4m3 conversion drops the carry of a value rounded up to the next
    # power of two (a GPU's does not): those codes are left out. Every other code is
    # torch's or its neighbour (the interpreter rounds ties up, not to even).
    carried = (want.abs() > exact.abs()) & (torch.frexp(want)[0].abs() == 0.5)
    close = (got - want).abs() <= want.abs() * 2.0 ** -3 + 2.0 ** -9
    assert torch.all(close | carried)
    assert (got == want)[~carried].float().mean() > 0.95
    assert not got[2].any()


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_triton_fp8_gemv_matches_the_dequantized_matmul(rows: int) -> None:
    torch.manual_seed(rows)
    codes, scale = fp8.quantize(torch.randn(48, 300))
    x = torch.randn(rows, 300).bfloat16()
    bias = torch.randn(48).bfloat16()
    got = fp8_gemv(x, codes, scale, bias)
    want = x.float() @ (codes.float() * scale[:, None]).T + bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2 ** -7)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_gemv(torch.randn(17, 300).bfloat16(), codes, scale, None)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_support import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("triton-qwen3") / "m", "qwen3", seed=3)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-step"])
def test_triton_engine_decodes_the_torch_engines_tokens(qwen3: Path, graphs: bool) -> None:
    """The engine on the Triton kernels (as on CUDA: rope indexed in the kernel, attention
    reading the lengths from memory; with ``graphs`` the static step a graph replays)
    gives the torch engine's greedy tokens, and a prefill chunk after a cached prefix
    its whole prefill's logits."""
    from aegaeon_engine import Engine
    from engine_support import Bound, block_lists, prompts_of

    prompts = prompts_of((5, 16, 17), seed=1)
    blocks = block_lists(3, 3)
    want = Bound(qwen3, engine=Engine("cpu", native=False)).greedy(prompts, 3, blocks)
    ours = Bound(qwen3, engine=Engine("cpu", native=False, triton=True, graphs=graphs))
    assert ours.engine.attention.decode_kernel == "triton"
    assert ours.greedy(prompts, 3, blocks) == want
    assert ours.engine.graph_stats.replays == (2 if graphs else 0)
    prompt = prompts_of([40], seed=4)[0]
    whole = ours.engine.prefill(prompt, [20, 21, 22])
    ours.engine.prefill(prompt[:18], [30, 31, 32])
    chunk = ours.engine.prefill(prompt[18:], [30, 31, 32], start_pos=18)
    torch.testing.assert_close(chunk, whole, atol=1e-4, rtol=0)
