"""The native CPU kernels (paged decode attention, decode projections, the fused elementwise
ops of a layer) against the torch path on every ISA level this CPU supports, the choice
of the level (``AEGAEON_ISA``), and the fallback when a level is turned off or cannot be
built."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_common.env import read_env
from aegaeon_engine import DecodeSeq, Engine, ModelSpec, RopeSpec
from aegaeon_engine import kernels as kernels_mod
from aegaeon_engine import native as native_mod
from aegaeon_engine.attention import Attention
from aegaeon_engine.kernels import NativeOps, layer_ops, project_widened
from aegaeon_engine.model import KVViews, LayerOps, Tokens, project
from aegaeon_engine.rope import RopeTable
from aegaeon_engine.weights import LayerWeights
from engine_support import Bound, block_lists, hf_greedy, make_checkpoint, prompts_of

CPU = torch.device("cpu")
# per dtype: (atol, rtol) of the native result against the float64 / torch reference
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2),
             torch.float16: (1e-3, 1e-3)}


LEVELS = native_mod.supported_levels()  # this CPU's: every kernel test runs on each


@pytest.fixture(scope="session")
def built_levels() -> tuple[str, ...]:
    """Every supported level built once per session (the missing ones in parallel); the
    tests that need them skip where there are none (no level, or ``AEGAEON_NATIVE=0``)."""
    if not read_env().native_kernels or not LEVELS:
        pytest.skip("no native kernels here")
    native_mod.prebuild(LEVELS)
    return LEVELS


@pytest.fixture(params=LEVELS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no native level for this CPU"))])
def isa(request: pytest.FixtureRequest, built_levels: tuple[str, ...]) -> str:
    """One supported level (the kernels of every level are loaded side by side)."""
    return str(request.param)


@pytest.fixture
def fresh_native() -> Iterator[None]:
    """Forget the chosen level before and after (the env is restored by then)."""
    native_mod.forget()
    yield
    native_mod.forget()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The kernels' serial and parallel (at::parallel_for) paths."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_native_kernels_load(isa: str) -> None:
    ops: Any = native_mod.native_ops(isa)
    assert ops is not None, f"the {isa} kernels failed to build (see log)"
    assert ops is getattr(torch.ops, f"aegaeon_{isa}")  # one namespace per level
    assert ops.linear_supported(torch.float32) and ops.linear_supported(torch.bfloat16)
    assert ops.bf16_native() == native_mod.level(isa).bf16_native
    attention = Attention(CPU, isa=isa)
    assert attention.native is ops and attention.isa == isa


def test_best_level_is_chosen(monkeypatch: pytest.MonkeyPatch, fresh_native: None,
                              built_levels: tuple[str, ...]) -> None:
    monkeypatch.delenv("AEGAEON_ISA", raising=False)
    assert native_mod.native_isa() == LEVELS[-1]
    engine = Engine()
    assert engine.isa == LEVELS[-1] and engine.native_kernels
    assert isinstance(engine.ops, NativeOps) and engine.ops.isa == LEVELS[-1]


def test_supported_levels_follow_cpu_flags() -> None:
    avx2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert native_mod.supported_levels(frozenset({"avx2", "f16c"}), "x86_64") == ()
    assert native_mod.supported_levels(avx2, "x86_64") == ("avx2",)
    assert native_mod.supported_levels(avx512 | {"avx512_bf16"}, "x86_64") == ("avx2", "avx512")
    amx = avx512 | {"avx512_bf16", "amx_tile", "amx_bf16"}
    assert native_mod.supported_levels(amx, "x86_64") == ("avx2", "avx512", "amx")
    assert native_mod.supported_levels(frozenset({"fp", "asimd"}), "aarch64") == ("neon",)
    keys = {native_mod.build_key(name) for name in ("avx2", "avx512", "amx", "neon")}
    assert len(keys) == 4  # a build cache entry per level


def test_env_forces_a_lower_level(monkeypatch: pytest.MonkeyPatch, fresh_native: None,
                                  built_levels: tuple[str, ...]) -> None:
    monkeypatch.setenv("AEGAEON_ISA", LEVELS[0])
    assert native_mod.native_isa() == LEVELS[0]
    engine = Engine()
    assert engine.isa == LEVELS[0] and engine.attention.native is native_mod.native_ops(LEVELS[0])
    # a forced level behaves as a CPU with only its features
    assert engine.compute_dtype == ("bfloat16" if native_mod.level(LEVELS[0]).bf16_native
                                    else "float32")


def test_env_unknown_or_unsupported_level_is_an_error(monkeypatch: pytest.MonkeyPatch,
                                                      fresh_native: None) -> None:
    monkeypatch.setenv("AEGAEON_ISA", "sse9")
    with pytest.raises(ValueError, match="ISA"):
        native_mod.native_isa()
    missing = [lv.name for lv in native_mod.LEVELS if lv.name not in LEVELS]
    monkeypatch.setenv("AEGAEON_ISA", missing[0])  # another machine's level, or amx etc.
    with pytest.raises(ValueError, match="this CPU"):
        Engine()
    monkeypatch.delenv("AEGAEON_ISA")
    with pytest.raises(ValueError, match="not supported by this CPU"):
        Engine(isa=missing[0])


def _native(isa: str) -> NativeOps:
    ops = layer_ops(CPU, isa=isa)
    assert isinstance(ops, NativeOps) and ops.isa == isa
    return ops


def _spec(q_heads: int, kv_heads: int, dim: int, layers: int) -> ModelSpec:
    return ModelSpec("t", "Qwen3ForCausalLM", 100, q_heads * dim, 100, layers, q_heads, kv_heads,
                     dim, 1e-6, RopeSpec(1e4), 4096)


def _kv(dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int, num_blocks: int,
        layers: int, g: torch.Generator) -> KVViews:
    spec = _spec(q_heads, kv_heads, dim, layers)
    region = torch.empty(num_blocks * 2 * layers * 16 * kv_heads * dim * dtype.itemsize,
                         dtype=torch.uint8)
    kv = KVViews.over(region, spec, 16, dtype)
    kv.cache.copy_(torch.randn(kv.cache.shape, generator=g).to(dtype))
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [
    (4, 4, 16), (8, 2, 64), (8, 4, 128), (6, 2, 40), (16, 1, 32), (12, 4, 128),
])  # MHA, GQA 2..16 (16: split into two groups of 8), head_dim off the vector width (40)
def test_paged_decode_matches_torch_path(dtype: torch.dtype, q_heads: int, kv_heads: int,
                                         dim: int, threads: int, isa: str) -> None:
    g = torch.Generator().manual_seed(q_heads * dim)
    layers, lengths = 3, [1, 17, 33, 150, 16, 32, 5]
    kv = _kv(dtype, q_heads, kv_heads, dim, 80, layers, g)
    per_seq = -(-max(lengths) // 16)
    table = torch.randperm(80, generator=g)[:len(lengths) * per_seq].view(len(lengths), -1)
    lens = torch.tensor(lengths)
    # column-major, as decode's projections leave it
    qkv = torch.randn((q_heads + 2 * kv_heads) * dim, len(lengths), generator=g).to(dtype)
    qkv = qkv.t().view(len(lengths), -1, dim)
    native = Attention(CPU, isa=isa).paged_decode(kv, q_heads, table, lens, lengths)
    reference = Attention(CPU, native=False)
    exact = _kv(torch.float32, q_heads, kv_heads, dim, 80, layers, g)
    exact.cache.copy_(kv.cache)
    atol, rtol = TOLERANCE[dtype]
    for layer in range(layers):
        got = native(layer, qkv).float()
        want = reference.paged_decode(exact, q_heads, table, lens, lengths)(layer, qkv.float())
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        same = reference.paged_decode(kv, q_heads, table, lens, lengths)(layer, qkv).float()
        if dtype == torch.bfloat16:  # no worse than torch's own bfloat16 on this CPU
            err, torch_err = (got - want).abs().max(), (same - want).abs().max()
            assert err <= 1.5 * torch_err + 2**-8 * want.abs().max()
        else:
            torch.testing.assert_close(got, same, atol=2 * atol, rtol=2 * rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (100, 160), (37, 50),
                                                           (8, 96), (272, 1664)])
def test_project_matches_torch(dtype: torch.dtype, rows: int, out_features: int,
                               in_features: int, threads: int, isa: str) -> None:
    """amx: AMX tiles (in % 32 == 0, out >= 16), else vdpbf16ps; every level: float32
    arithmetic on bfloat16 widened in registers (ragged ends of in: 50, 37); strided x."""
    ops = _native(isa)
    assert dtype in ops.project_dtypes
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    x = torch.randn(rows, 2 * in_features, generator=g).to(dtype)[:, ::2]  # strided rows
    for b in (None, bias):
        got = ops.project(w, x, b)
        assert got.shape == (rows, out_features) and got.is_contiguous()
        want = x.double() @ w.double().t() + (0 if b is None else b.double())
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        else:  # as close as torch's own bfloat16 matmul, up to one rounding
            scale = want.abs().max().item()
            err = (got.double() - want).abs().max().item()
            ref = (project(w, x, b).double() - want).abs().max().item()
            assert err <= max(2 * ref, 2**-8 * scale)


@pytest.mark.parametrize("rows", [4, 8, 16])
@pytest.mark.parametrize("in_features", [64, 576, 1552, 1605])
def test_project_row_blocks_match_single_rows(rows: int, in_features: int, isa: str) -> None:
    """bfloat16 at decode batch sizes: each x row of a block gets the bits it gets alone,
    and a float64 reference up to the result's rounding. AVX2 takes blocks of 4 x rows x
    3 weight rows in assembly over whole cache lines of the rows (in 64, 576: all of
    them; 1552: then one step of 16; 1605: and a ragged end), summing every lane in the
    order of the one-row path; other levels give the same bits where they sum in one order."""
    ops = _native(isa)
    g = torch.Generator().manual_seed(rows * in_features)
    out_features = 99  # parallel tasks of 24 rows, 3 strips each, then 3 rows left
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    got = ops.project(w, x, None)
    want = x.double() @ w.double().t()
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2**-8 * scale
    if isa == "avx2":
        alone = torch.cat([ops.project(w, x[i:i + 1], None) for i in range(rows)])
        assert torch.equal(got, alone)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: the same bits as the torch path; float32: up to float32 sum order."""
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "size"), [(1, 512), (8, 1664), (3, 40), (40, 64)])
def test_rms_norm_and_silu_mul_match_torch(dtype: torch.dtype, rows: int, size: int,
                                           threads: int, isa: str) -> None:
    ops, torch_ops = _native(isa), LayerOps()
    g = torch.Generator().manual_seed(size)
    x = (3 * torch.randn(rows, size, generator=g)).to(dtype)
    w = torch.randn(size, generator=g).to(dtype)
    for weight in (w, None):
        _same(ops.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x.clone(), weight, 1e-6))
    gate_up = (3 * torch.randn(rows, 2 * size, generator=g)).to(dtype)
    got = ops.silu_mul(gate_up.clone())
    want = torch_ops.silu_mul(gate_up.clone())
    if dtype == torch.bfloat16:  # its own exp: a rare last-bit difference after rounding
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim", "qk_norm"), [
    (8, 4, 128, True), (4, 2, 64, False), (4, 2, 16, True), (2, 1, 40, True),
])
def test_rope_write_matches_torch(dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int,
                                  qk_norm: bool, threads: int, isa: str) -> None:
    """q/k norm + rope in place and the K/V slot writes, as the torch path does them."""
    ops, torch_ops = _native(isa), LayerOps()
    g = torch.Generator().manual_seed(dim)
    spec = _spec(q_heads, kv_heads, dim, 2)
    block_bytes = 2 * 2 * 16 * kv_heads * dim * dtype.itemsize
    regions = [torch.zeros(20 * block_bytes, dtype=torch.uint8) for _ in range(2)]
    kvs = [KVViews.over(r, spec, 16, dtype) for r in regions]
    table = RopeTable(dim, spec.rope, 4096, dtype, CPU).ensure(200)
    positions = torch.tensor([5, 100, 150, 151])
    cos_sin = table.index_select(1, positions)[:, :, None]
    tokens = Tokens(torch.zeros(4, dtype=torch.long), cos_sin[0], cos_sin[1],
                    torch.tensor([3, 7, 9, 9]), positions % 16)
    norms = [torch.randn(dim, generator=g).to(dtype) if qk_norm else None for _ in range(2)]
    unused = torch.empty(0)
    lw = LayerWeights(input_norm=unused, qkv=unused, qkv_bias=None, q_norm=norms[0],
                      k_norm=norms[1], o_proj=unused, o_bias=None, post_norm=unused,
                      gate_up=unused, down=unused)
    qkv = torch.randn(4, q_heads + 2 * kv_heads, dim, generator=g).to(dtype)
    got, want = qkv.clone(), qkv.clone()
    ops.rope_write(got, lw, kvs[0], 1, tokens, q_heads, 1e-6)
    torch_ops.rope_write(want, lw, kvs[1], 1, tokens, q_heads, 1e-6)
    _same(got, want)
    _same(kvs[0].cache, kvs[1].cache)
    assert kvs[0].cache[:, 0].abs().sum() == 0  # layer 0 untouched


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3"])
def test_engine_native_equals_torch_path(tmp_path: Path, variant: str, isa: str) -> None:
    """Ragged batched decode step by step: float32 equal to the torch path up to sum
    order; bfloat16 no farther from the float32 logits than the torch path's bfloat16
    (whose rounding is this CPU's: no constant bound holds on every CPU)."""
    ckpt = make_checkpoint(tmp_path / variant, variant, seed=3)
    prompts = prompts_of((3, 16, 30, 47), seed=9)
    blocks = block_lists(4, 6)
    exact = Bound(ckpt, dtype="float32", engine=Engine(native=False))
    for dtype in ("float32", "bfloat16"):
        fast = Bound(ckpt, dtype=dtype, engine=Engine(isa=isa))
        slow = Bound(ckpt, dtype=dtype, engine=Engine(native=False))
        outs = [[int(exact.engine.prefill(p, b).argmax())] for p, b in zip(prompts, blocks,
                                                                          strict=True)]
        for p, b in zip(prompts, blocks, strict=True):
            fast.engine.prefill(p, b)
            slow.engine.prefill(p, b)
        for _ in range(6):
            seqs = [DecodeSeq(o[-1], len(p) + len(o) - 1, b)
                    for p, o, b in zip(prompts, outs, blocks, strict=True)]
            got, want, ref = (e.engine.decode(seqs) for e in (fast, slow, exact))
            if dtype == "float32":
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            else:
                err, torch_err = (got - ref).abs().max(), (want - ref).abs().max()
                assert err <= 1.5 * torch_err + 0.02, (err, torch_err)
            outs = [[*o, t] for o, t in zip(outs, ref.argmax(-1).tolist(), strict=True)]


def test_torch_path_greedy_equals_transformers(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=4)
    prompts = prompts_of((5, 17, 33), seed=1)
    ours = Bound(ckpt, engine=Engine(native=False)).greedy(prompts, 32, block_lists(3, 5))
    assert ours == hf_greedy(ckpt, prompts, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(17, 64, 96), (128, 700, 50)])
def test_widened_prefill_projection(dtype: torch.dtype, rows: int, out_features: int,
                                    in_features: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill-sized projections in float32 arithmetic (blocks of weight rows converted):
    the float32 result rounded once, whatever the block size."""
    monkeypatch.setattr(kernels_mod, "_BLOCK_ELEMS", 37 * in_features)  # ragged blocks
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    for b in (None, bias):
        got = project_widened(w, x, b)
        want = torch.addmm(b.float(), x.float(), w.float().t()) if b is not None else (
            x.float() @ w.float().t())
        assert got.dtype == dtype and got.shape == (rows, out_features) and got.is_contiguous()
        torch.testing.assert_close(got, want.to(dtype), atol=1e-5, rtol=1e-5)


def test_prefill_follows_the_compute_dtype(tmp_path: Path, isa: str) -> None:
    """bfloat16 prefill in float32 arithmetic where the level has no native bfloat16;
    its logits are as close to float32 transformers-exact ones as the torch path's."""
    ckpt = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=5)
    prompt = prompts_of((40,), seed=2)[0]
    exact = Bound(ckpt, dtype="float32", engine=Engine(native=False))
    want = exact.engine.prefill(prompt, block_lists(1, 5)[0])
    engine = Engine(isa=isa)
    ops = engine.ops
    assert isinstance(ops, NativeOps)
    assert ops.bf16_native == native_mod.bf16_native(isa)
    got = Bound(ckpt, dtype="bfloat16", engine=engine).engine.prefill(prompt,
                                                                      block_lists(1, 5)[0])
    ref = Bound(ckpt, dtype="bfloat16", engine=Engine(native=False)).engine.prefill(
        prompt, block_lists(1, 5)[0])
    err, ref_err = (got - want).abs().max().item(), (ref - want).abs().max().item()
    assert err <= 2 * ref_err + 1e-3


def test_imports_do_not_build() -> None:
    """Only making an Engine (or calling native_ops) loads or builds the kernels."""
    code = ("import aegaeon_engine.engine, aegaeon_engine.kernels, aegaeon_engine.llm\n"
            "from aegaeon_engine import native\n"
            "assert not native._loaded and native._select.cache_info().misses == 0\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_env_forces_torch_path(monkeypatch: pytest.MonkeyPatch, fresh_native: None) -> None:
    monkeypatch.setenv("AEGAEON_NATIVE", "0")
    assert native_mod.native_ops() is None and native_mod.native_isa() is None
    engine = Engine()
    assert engine.attention.native is None and engine.isa == "torch"
    assert type(engine.ops) is LayerOps


def _break_levels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, names: list[str]) -> None:
    """Levels ``names`` built with a flag the compiler refuses, in a scratch cache."""
    monkeypatch.setattr(native_mod, "_loaded", {})  # loaded libraries load again (no-op)
    by_name = dict(native_mod._BY_NAME)
    for name in names:
        lv = by_name[name]
        by_name[name] = dataclasses.replace(lv, cflags=(*lv.cflags, "-fno-such-flag-aegaeon"))
    monkeypatch.setattr(native_mod, "_BY_NAME", by_name)
    directory = native_mod._directory

    def scratch(name: str) -> Path:
        return tmp_path / name if name in names else directory(name)

    monkeypatch.setattr(native_mod, "_directory", scratch)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aegaeon_engine.native"]


def test_build_failure_falls_back_a_level(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          fresh_native: None, built_levels: tuple[str, ...],
                                          caplog: pytest.LogCaptureFixture) -> None:
    if len(LEVELS) < 2:
        pytest.skip("needs two native levels")
    monkeypatch.delenv("AEGAEON_ISA", raising=False)
    _break_levels(monkeypatch, tmp_path, [LEVELS[-1]])
    with caplog.at_level(logging.WARNING, logger="aegaeon_engine.native"):
        assert native_mod.native_isa() == LEVELS[-2]
        assert native_mod.native_ops() is getattr(torch.ops, f"aegaeon_{LEVELS[-2]}")
    [line] = _messages(caplog)  # one line: which failed, why, what runs instead
    assert f"{LEVELS[-1]} unavailable" in line and "no-such-flag" in line
    assert line.endswith(f"using {LEVELS[-2]}")
    assert Engine().isa == LEVELS[-2]


def test_build_failure_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           fresh_native: None,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("AEGAEON_NATIVE", raising=False)
    monkeypatch.delenv("AEGAEON_ISA", raising=False)
    _break_levels(monkeypatch, tmp_path, list(LEVELS))
    with caplog.at_level(logging.WARNING, logger="aegaeon_engine.native"):
        assert native_mod.native_ops() is None
        assert native_mod.native_ops() is None  # tried once, logged once
    [line] = _messages(caplog)
    assert line.endswith("using the torch path")
    engine = Engine()
    assert engine.attention.native is None and type(engine.ops) is LayerOps
