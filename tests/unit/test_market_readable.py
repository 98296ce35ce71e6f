"""Market models transformers cannot read as they are (issue 36): GGUF blocks kept and FP8.

`aegaeon_market.readable` names why and writes the weights dequantized; a GGUF-blocks
model directory imports again (``market add``) as it is, or into float weights equal to
the GGUF file's own float import; ``gguf_export`` writes kept blocks back bit for bit,
and ``q8_0`` quantizes a float model as llama.cpp's converter does.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import pytest
import torch
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.loader import checkpoint_index, read_tensor
from aegaeon_engine.spec import ModelSpec
from aegaeon_market.edit import add_model
from aegaeon_market.gguf_export import write_gguf
from aegaeon_market.readable import transformers_dir, transformers_unreadable
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from market_import_support import Tiny, hf_tensors
from market_import_support import write_gguf as write_source_gguf

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model's Q4_1 file imported three ways: its blocks kept (``q4``), float32
    (``f32``), and FP8 made from the kept model (``fp8``)."""
    tmp = tmp_path_factory.mktemp("readable")
    tiny = Tiny(tied=False)
    source = tmp / "tiny.Q4_1.gguf"
    write_source_gguf(source, tiny, hf_tensors(tiny), Q.Q4_1)
    root = tmp / "market"
    add_model(root, source, "q4", progress=False)
    add_model(root, source, "f32", "float32", progress=False)
    add_model(root, root / "q4", "fp8", "fp8", progress=False)
    return root


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    index = checkpoint_index(model_dir)
    return {name: read_tensor(entry, name, blocks=entry.code == "U8")
            for name, entry in index.items()}


def test_why_transformers_cannot_read_it(market: Path) -> None:
    assert transformers_unreadable(market / "f32") is None
    q4 = transformers_unreadable(market / "q4")
    assert q4 is not None and q4.startswith("q4_1 GGUF blocks")
    fp8 = transformers_unreadable(market / "fp8")
    assert fp8 is not None and fp8.startswith("FP8 weights")


def test_a_float_model_is_read_where_it_is(market: Path, tmp_path: Path) -> None:
    assert transformers_dir(market / "f32", tmp_path) == market / "f32"
    assert list(tmp_path.iterdir()) == []


def test_blocks_dequantize_to_the_files_own_float_import(market: Path, tmp_path: Path) -> None:
    out = transformers_dir(market / "q4", tmp_path, "float32")
    assert out.parent == tmp_path and transformers_unreadable(out) is None
    assert transformers_dir(market / "q4", tmp_path, "float32") == out  # written once
    ours, want, kept = _tensors(out), _tensors(market / "f32"), _tensors(market / "q4")
    assert set(ours) == set(want)
    for name, tensor in want.items():  # the blocks exactly; the rest as the q4 model holds it
        held = tensor if kept[name].dtype == torch.uint8 else tensor.to(kept[name].dtype).float()
        assert torch.equal(ours[name], held), name
    assert ModelSpec.from_dir(out).quant is None


def test_transformers_loads_what_it_is_given(market: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    for name in ("q4", "fp8"):
        with pytest.raises((RuntimeError, ImportError, ValueError, OSError)):
            AutoModelForCausalLM.from_pretrained(market / name)
        model = AutoModelForCausalLM.from_pretrained(transformers_dir(market / name, tmp_path,
                                                                      "bfloat16"))
        assert next(model.parameters()).dtype == torch.bfloat16


def test_a_blocks_model_imports_again_as_it_is(market: Path, tmp_path: Path) -> None:
    entry = add_model(tmp_path / "other", market / "q4", "again", progress=False)
    assert entry.dtype == "q4_1"
    assert filecmp.cmp(entry.path / "model.safetensors", market / "q4" / "model.safetensors",
                       shallow=False)
    assert ModelSpec.from_dir(entry.path).quant == ModelSpec.from_dir(market / "q4").quant


def test_blocks_of_the_wrong_dtype_name_the_tensor(market: Path, tmp_path: Path) -> None:
    from aegaeon_market.hf_import import read_hf_dir
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for path in (market / "q4").iterdir():
        if path.name != "model.safetensors":
            (broken / path.name).write_bytes(path.read_bytes())
    tensors = _tensors(market / "q4")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)  # the right shape, not U8
    save_file({n: t.contiguous() for n, t in tensors.items()}, broken / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        read_hf_dir(broken)
    assert name in str(err.value) and "U8" in str(err.value)


def test_export_writes_kept_blocks_bit_for_bit(market: Path, tmp_path: Path) -> None:
    source = {t.name: t for t in GGUFReader(market.parent / "tiny.Q4_1.gguf").tensors}
    out = {t.name: t for t in GGUFReader(write_gguf(market / "q4", tmp_path / "q4.gguf",
                                                    "bfloat16")).tensors}
    assert set(out) == set(source)
    for name, tensor in source.items():  # the blocks as the file holds them
        want = np.asarray(tensor.data)
        if tensor.tensor_type == Q.F32:  # norms: as the q4 model holds them (bfloat16)
            want = torch.from_numpy(want.copy()).to(torch.bfloat16).float().numpy()
        assert out[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(out[name].data), want), name


def test_export_quantizes_to_q8_0_as_the_gguf_package(market: Path, tmp_path: Path) -> None:
    path = write_gguf(market / "f32", tmp_path / "q8.gguf", "q8_0")
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    up = tensors["blk.1.ffn_up.weight"]
    assert up.tensor_type == Q.Q8_0
    assert tensors["blk.1.ffn_norm.weight"].tensor_type == Q.F32
    name = "model.layers.1.mlp.up_proj.weight"
    values = _tensors(market / "f32")[name].numpy()
    want = dequantize(quantize(values, Q.Q8_0), Q.Q8_0)
    assert np.array_equal(dequantize(np.asarray(up.data), Q.Q8_0).reshape(want.shape), want)
    entry = add_model(tmp_path / "m", path, "q8", progress=False)  # its blocks kept again
    assert entry.dtype == "q8_0"


def test_fp8_has_no_gguf_export(market: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        write_gguf(market / "fp8", tmp_path / "fp8.gguf")
    assert "quantization_config" in str(err.value)
