"""GGUF block-quantized weights served as such (quant.py, csrc/quant.cpp): the kernels of
every ISA level this CPU runs against float references of the dequantized weights,
with tolerances from float32 (and bfloat16) rounding; the layout and the spec.

The decode kernel multiplies x quantized per block to int8 (as llama.cpp's Q8
activations), so its reference is ``quantize_x(x) @ dequantize(w).T``: exact integer
block sums, then float32 scaling and summing, bounded by ``eps * terms * |x||w|``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from aegaeon_common.dtypes import QUANT_BLOCKS
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.layout import weight_layout
from aegaeon_engine.model import LayerOps
from aegaeon_engine.native import native_ops, supported_levels
from aegaeon_engine.quant import (
    QuantTensor,
    dequantize,
    dequantize_weight,
    project_quant,
    project_reference,
    quantize_x,
)
from aegaeon_engine.spec import ModelSpec, QuantSpec
from aegaeon_engine.weights import bind_weights

EPS32 = 2.0 ** -24  # float32's unit roundoff
EPS_BF16 = 2.0 ** -8  # bfloat16's unit roundoff


def random_quant(qtype: str, rows: int, in_features: int, seed: int = 0) -> QuantTensor:
    """Random codes with float16 scales of varied magnitude (and offsets, q4_1)."""
    gen = torch.Generator().manual_seed(seed)
    elems, nbytes = QUANT_BLOCKS[qtype]
    blocks = torch.randint(0, 256, (rows, in_features // elems, nbytes), dtype=torch.uint8,
                           generator=gen)
    scales = (torch.rand(rows, in_features // elems, 2, generator=gen) * 0.02 + 1e-3)
    scales[..., 1] -= 0.012  # q4_1's minimum, either sign
    blocks[..., :4] = scales.half().view(torch.uint8)[..., :4]
    raw = blocks.reshape(-1).clone()
    return QuantTensor.over(raw, qtype, (rows, in_features))


def levels() -> list[str]:
    return [lv for lv in supported_levels() if native_ops(lv) is not None]


def decode_bound(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 rounding of the kernel's sums: per block a scale product and an FMA, the
    blocks' partial sums and the offset term: ``(blocks + 8) * eps * |x||w|``."""
    terms = w.shape[1] // 32 + 8
    return (xq.abs().double() @ w.abs().double().t()) * EPS32 * terms + 1e-30


@pytest.mark.parametrize("qtype", sorted(QUANT_BLOCKS))
def test_reference_dequantization_matches_the_gguf_package(qtype: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = random_quant(qtype, 7, 96)
    expected = gguf_dequantize(w.numpy(), GGMLQuantizationType[qtype.upper()])
    assert torch.equal(dequantize_weight(w), torch.from_numpy(expected).float())


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("qtype", sorted(QUANT_BLOCKS))
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 13, 16])
def test_decode_projection_matches_the_dequantized_reference(level: str, qtype: str,
                                                             batch: int) -> None:
    ops = native_ops(level)
    w = random_quant(qtype, 37, 160, seed=batch)  # rows not a multiple of any strip count
    x = torch.randn(batch, 160, generator=torch.Generator().manual_seed(batch))
    bias = torch.randn(37)
    got = project_quant(ops, w, x, bias)
    xq = quantize_x(x)
    ref = xq.double() @ dequantize_weight(w).double().t() + bias.double()
    bound = decode_bound(xq, dequantize_weight(w)) + bias.abs().double() * EPS32
    assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("level", levels())
def test_decode_projection_in_bfloat16_rounds_once(level: str) -> None:
    ops = native_ops(level)
    w = random_quant("q4_1", 24, 64)
    x = torch.randn(3, 64).bfloat16()
    got = project_quant(ops, w, x, None)
    assert got.dtype == torch.bfloat16
    xq = quantize_x(x)
    ref = xq.double() @ dequantize_weight(w).double().t()
    bound = decode_bound(xq, dequantize_weight(w)) * 2 + ref.abs() * EPS_BF16 * 1.01
    assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("qtype", sorted(QUANT_BLOCKS))
def test_prefill_dequantizes_blocks_exactly(level: str, qtype: str) -> None:
    ops = native_ops(level)
    w = random_quant(qtype, 40, 96)
    ref = dequantize_weight(w)
    got = torch.empty_like(ref)
    ops.qdequant(got, w, {"q8_0": 8, "q4_0": 2, "q4_1": 3}[qtype])
    if qtype == "q4_1":  # one fused d * q + m: within one rounding of d * q + m
        scale = dequantize(w, qtype, 96).abs() + ref.abs()
        assert ((got - ref).abs() <= scale * EPS32 * 2).all()
    else:
        assert torch.equal(got, ref)
    x = torch.randn(40, 96)  # more rows than a decode batch: the GEMM path
    out = project_quant(ops, w, x, None)
    gemm = F.linear(x.double(), ref.double())
    bound = (x.abs().double() @ ref.abs().double().t()) * EPS32 * (96 + 4)
    assert ((out.double() - gemm).abs() <= bound).all()


def test_torch_path_projects_the_dequantized_weights() -> None:
    w = random_quant("q8_0", 16, 64)
    x = torch.randn(4, 64)
    got = LayerOps().project(w, x, None)
    assert torch.equal(got, project_reference(w, x, None))
    assert torch.allclose(got, x @ dequantize_weight(w).t(), rtol=1e-5, atol=1e-6)


def test_quant_tensor_is_plain_bytes_to_torch() -> None:
    w = random_quant("q4_0", 4, 64)
    assert w.dtype == torch.uint8 and tuple(w.shape) == (4, 36)
    assert (w.qtype, w.in_features, w.out_features) == ("q4_0", 64, 4)
    assert type(w[1:3]) is torch.Tensor  # torch functions see (and return) bytes


def _config(quant: dict[str, object] | None) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "dtype": "bfloat16"}
    if quant is not None:
        config["quantization_config"] = quant
    return config


def test_layout_keeps_matrices_in_blocks() -> None:
    spec = ModelSpec.from_config(_config({"quant_method": "gguf", "linear": "q4_1",
                                          "embed_tokens": "q8_0"}))
    assert spec.quant == QuantSpec("q4_1", "q8_0", None)
    assert spec.weight_dtype == "q4_1" and spec.dtype == "bfloat16"
    layout = weight_layout(spec)
    qkv, norm = layout.slot("layers.0.qkv_proj"), layout.slot("layers.0.input_norm")
    assert (qkv.dtype, qkv.shape, qkv.nbytes) == ("q4_1", (128, 64), 128 * 2 * 20)
    assert layout.slot("embed_tokens").nbytes == 96 * 2 * 34
    assert (norm.dtype, norm.nbytes) == ("bfloat16", 128)
    dense = weight_layout(ModelSpec.from_config(_config(None)))
    assert layout.total_bytes < dense.total_bytes / 2
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    bound = bind_weights(spec, layout, buffer)
    assert isinstance(bound.layers[1].down, QuantTensor)
    assert bound.layers[1].down.in_features == 128
    assert bound.embed_tokens is bound.lm_head and bound.dtype == torch.bfloat16


@pytest.mark.parametrize(("quant", "field"), [
    ({"quant_method": "gptq", "linear": "q4_1"}, "quantization_config.quant_method"),
    ({"quant_method": "gguf"}, "quantization_config.linear"),
    ({"quant_method": "gguf", "linear": "q5_k"}, "quantization_config.linear"),
    ({"quant_method": "gguf", "linear": "q4_0", "embed_tokens": 3},
     "embed_tokens"),
])
def test_bad_quantization_config_names_the_field(tmp_path: Path, quant: dict[str, object],
                                                 field: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config(quant)))
    with pytest.raises(CheckpointError) as info:
        ModelSpec.from_dir(tmp_path)
    assert field in str(info.value) and "config.json" in str(info.value)
