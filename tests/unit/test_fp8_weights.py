"""FP8 (e4m3) weights with per-row scales served as such (fp8.py): the quantization's
error bound, the slot's bytes and views, the spec's FP8 configs, the scaled-mm seam
against the dequantized projection, and the one log line of the fallback.

e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below
2^-6 (subnormal codes) the spacing is 2^-9, so within 2^-10 absolutely. In a
row scaled to ``amax / 448`` that is ``|w| / 16 + amax / 448 * 2^-10``.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_common.dtypes import FP8, fp8_scales_offset, quant_matrix_bytes
from aegaeon_engine import fp8
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.fp8 import Fp8Tensor, dequantize, project_scaled, quantize
from aegaeon_engine.layout import weight_layout
from aegaeon_engine.model import LayerOps, project
from aegaeon_engine.spec import ModelSpec
from aegaeon_engine.weights import bind_weights

EPS32 = 2.0 ** -24
EPS_BF16 = 2.0 ** -8


def rounding_bound(w: torch.Tensor) -> torch.Tensor:
    """The e4m3 rounding bound of every element of ``w`` (module docstring), plus float32's
    rounding of the division and the product."""
    amax = w.abs().amax(1, keepdim=True)
    return w.abs() / 16 + amax / 448 * 2.0 ** -10 + 4 * EPS32 * w.abs() + 1e-30


def random_weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, each with a few outliers and some zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 3, rows)[:, None]
    w[:, 0] *= 20  # an outlier per row sets its scale
    w[:, 1] = 0.0
    return w


def fp8_weights(w: torch.Tensor, device: str = "cpu") -> tuple[Fp8Tensor, torch.Tensor]:
    """``w`` quantized into a slot's bytes (codes, then scales) on ``device``, and its
    dequantized values in float64 (the exact reference)."""
    codes, scale = quantize(w)
    raw = torch.cat([codes.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])
    return Fp8Tensor.over(raw.to(device), tuple(w.shape)), dequantize(codes, scale, torch.float64)


def assert_within_activation_rounding(out: torch.Tensor, x: torch.Tensor, wd: torch.Tensor,
                                      bias: torch.Tensor | None = None) -> None:
    """``out`` against the exact ``x @ wd.T (+ bias)``: x rounded to e4m3 per token, so off
    by that rounding times |w|, plus bfloat16's output rounding."""
    exact = x.double() @ wd.t() + (0 if bias is None else bias.double())
    bound = (rounding_bound(x.float()).double() @ wd.abs().t() + exact.abs() * EPS_BF16
             + 1e-6 * exact.abs().amax())
    assert out.dtype == torch.bfloat16 and bool(((out.double() - exact).abs() <= bound).all())


def test_fp8_round_trip_error_is_bounded_by_the_rows_amax() -> None:
    w = random_weights(64, 96)
    codes, scale = quantize(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(scale, w.abs().amax(1) / 448)
    back = dequantize(codes, scale, torch.float32)
    assert bool(((back - w).abs() <= rounding_bound(w)).all())
    assert torch.equal(back[:, 1], torch.zeros(64))
    # every row's largest magnitude lands on the largest code: the range is used
    assert torch.equal(codes.float().abs().amax(1), torch.full((64,), 448.0))


def test_fp8_zero_rows_and_bad_input() -> None:
    codes, scale = quantize(torch.zeros(3, 16))
    assert torch.equal(scale, torch.ones(3)) and not bool(codes.float().any())
    w = torch.ones(2, 16)
    w[1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize(w)
    with pytest.raises(ValueError, match="float matrix"):
        quantize(torch.ones(16))


def test_fp8_tensor_views_the_slots_bytes() -> None:
    rows, cols = 48, 40  # 1920 code bytes, scales from byte 1920
    codes, scale = quantize(random_weights(rows, cols))
    nbytes = quant_matrix_bytes(FP8, rows, cols)
    assert nbytes == fp8_scales_offset(rows, cols) + 4 * rows == rows * cols + 4 * rows
    raw = torch.zeros(nbytes + 64, dtype=torch.uint8)[:nbytes]
    raw[:rows * cols] = codes.view(torch.uint8).reshape(-1)
    start = fp8_scales_offset(rows, cols)
    raw[start:start + 4 * rows] = scale.view(torch.uint8)
    w = Fp8Tensor.over(raw, (rows, cols))
    assert w.shape == (rows, cols) and w.out_features == rows
    assert torch.equal(w.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(w.scale, scale)
    assert w.data_ptr() == raw.data_ptr()  # a view: a switch moves these bytes, nothing else
    assert type(w.t()) is torch.Tensor  # torch sees plain codes
    assert fp8_scales_offset(3, 5) == 16  # the scales stay 16-byte aligned


def _config(quant: dict[str, Any] | None, tied: bool = True) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}  # fmt: skip
    if quant is not None:
        config["quantization_config"] = quant
    return config


COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"g": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "strategy": "channel"}}},
              "ignore": ["lm_head"]}  # fmt: skip


@pytest.mark.parametrize("quant", [COMPRESSED, {"quant_method": "fp8",
                                                "activation_scheme": "dynamic"}])
def test_fp8_configs_parse_and_lay_out_one_byte_per_weight(quant: dict[str, Any]) -> None:
    spec = ModelSpec.from_config(_config(quant))
    assert spec.quant is not None and spec.quant.linear == FP8 and spec.weight_dtype == FP8
    assert spec.quant.embed_tokens is None and spec.quant.lm_head is None
    layout = weight_layout(spec, "bfloat16")
    dense = weight_layout(ModelSpec.from_config(_config(None)), "bfloat16")
    qkv = layout.slot("layers.0.qkv_proj")
    assert (qkv.dtype, qkv.shape) == (FP8, (128, 64))
    assert qkv.nbytes == 128 * 64 + 4 * 128
    assert layout.slot("embed_tokens").dtype == "bfloat16"
    assert layout.slot("layers.0.input_norm").dtype == "bfloat16"
    matrices = [s for s in dense.slots if s.dtype == "bfloat16" and len(s.shape) == 2
                and s.name != "embed_tokens"]
    saved = sum(s.nbytes for s in matrices) - sum(layout.slot(s.name).nbytes for s in matrices)
    assert saved == sum(s.nbytes // 2 - 4 * s.shape[0] for s in matrices)


@pytest.mark.parametrize(("quant", "field"), [
    ({**COMPRESSED, "ignore": []}, "quantization_config.ignore"),
    ({**COMPRESSED, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                        "strategy": "group"}}}},
     "quantization_config.config_groups.g.weights"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     "quantization_config.weight_block_size"),
    ({"quant_method": "awq"}, "quantization_config.quant_method"),
])
def test_unsupported_fp8_configs_name_the_field(tmp_path: Path, quant: dict[str, Any],
                                                field: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config(quant)))
    with pytest.raises(CheckpointError) as info:
        ModelSpec.from_dir(tmp_path)
    assert info.value.field == field


def test_fp8_scaled_matmul_stays_within_its_activation_rounding() -> None:
    """``project_scaled`` (the GPU path; torch runs ``_scaled_mm`` on the CPU too) against
    the dequantized weight's exact product: x is rounded to e4m3 per token, so the
    difference is bounded by that rounding times |w|, plus bfloat16's output rounding."""
    gen = torch.Generator().manual_seed(1)
    w, wd = fp8_weights(random_weights(64, 128, seed=2) * 1e-3)
    bias = torch.randn(64, generator=gen).to(torch.bfloat16)
    for n in (1, 5, 32):
        x = (torch.randn(n, 128, generator=gen) * torch.logspace(-2, 2, n)[:, None])
        x = x.to(torch.bfloat16)
        out = project_scaled(w, x, bias)
        assert out.shape == (n, 64), n
        assert_within_activation_rounding(out, x, wd, bias)


def test_fp8_fallback_is_the_dense_projection_of_the_dequantized_weight(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fp8, "_fallback_logged", threading.Event())
    codes, scale = quantize(random_weights(32, 64))
    raw = torch.cat([codes.view(torch.uint8).reshape(-1), scale.view(torch.uint8)])
    w = Fp8Tensor.over(raw, (32, 64))
    dense = dequantize(codes, scale, torch.bfloat16)
    assert fp8.fallback_reason(w, torch.zeros(1, 64)) == "device cpu has no FP8 matmul"
    ops = LayerOps()
    with caplog.at_level(logging.INFO, logger="aegaeon_engine.fp8"):
        for n in (1, 3, 200):
            x = torch.randn(n, 64).to(torch.bfloat16)
            assert torch.equal(ops.project(w, x, None), project(dense, x, None))
        xf = torch.randn(4, 64)
        assert torch.equal(ops.project(w, xf, None),
                           project(dequantize(codes, scale, torch.float32), xf, None))
    lines = [r.getMessage() for r in caplog.records if r.name == "aegaeon_engine.fp8"]
    assert lines == ["FP8 matmuls fall back to dequantized weights and a dense matmul: "
                     "device cpu has no FP8 matmul"]


def test_fp8_weights_bind_from_a_layout() -> None:
    spec = ModelSpec.from_config(_config(COMPRESSED, tied=False))
    layout = weight_layout(spec, "bfloat16")
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    bound = bind_weights(spec, layout, buffer)
    assert isinstance(bound.layers[0].qkv, Fp8Tensor)
    assert isinstance(bound.layers[1].down, Fp8Tensor)
    assert bound.layers[1].down.shape == (64, 128) and bound.layers[1].down.scale.shape == (64,)
    assert bound.embed_tokens.dtype == torch.bfloat16
    assert bound.lm_head.dtype == torch.bfloat16


@pytest.mark.gpu
def test_fp8_projection_on_cuda_uses_scaled_mm_where_the_device_has_it() -> None:
    """On a CUDA device of compute capability >= 8.9 ``project`` takes ``_scaled_mm`` (never
    the dense fallback) within the activation rounding bound; below 8.9 it says why not."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda")
    w, wd = fp8_weights(random_weights(256, 512, seed=3) * 1e-3, "cuda")
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 512, generator=gen)).to(torch.bfloat16)
    reason = fp8.fallback_reason(w, x.to(device))
    if torch.cuda.get_device_capability(device) < fp8.SCALED_MM_CAPABILITY:
        assert reason is not None and "compute capability" in reason
        return
    assert reason is None

    def dense(*_: object) -> torch.Tensor:
        raise AssertionError("the dense fallback ran on an FP8-capable device")

    assert_within_activation_rounding(fp8.project(w, x.to(device), None, dense).cpu(), x, wd)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fp8_projection_on_cuda_triton_kernels(rows: int) -> None:
    """The CUDA engine's FP8 projection (aegaeon_engine.gpu.ops): a decode batch (<= 16
    rows) on the Triton GEMV, a larger one on one quantization kernel and ``_scaled_mm``,
    both within the activation rounding bound of the exact product."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < fp8.SCALED_MM_CAPABILITY:
        pytest.skip("e4m3 needs compute capability >= 8.9")
    from aegaeon_engine.gpu.ops import project_fp8

    w, wd = fp8_weights(random_weights(256, 512, seed=5) * 1e-3, "cuda")
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert_within_activation_rounding(project_fp8(w, x.to(device), None).cpu(), x, wd)
