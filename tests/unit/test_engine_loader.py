"""Loading checkpoints into caller memory, and every way a checkpoint can be broken."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from aegaeon_engine import (
    CheckpointError,
    ModelSpec,
    bind_weights,
    fill_layout,
    load_weights,
    weight_layout,
)
from engine_support import make_checkpoint
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("loader") / "q2", "qwen2", seed=1,
                           dtype=torch.bfloat16, tie_word_embeddings=False)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "copy"))


def _load(model_dir: Path, dtype: str | None = None) -> torch.Tensor:
    spec = ModelSpec.from_dir(model_dir)
    layout = weight_layout(spec, dtype)
    dest = torch.empty(layout.total_bytes, dtype=torch.uint8)
    load_weights(model_dir, spec, layout, dest)
    return dest


def test_packed_slots_hold_the_checkpoint_tensors(ckpt: Path) -> None:
    spec = ModelSpec.from_dir(ckpt)
    layout = weight_layout(spec)
    buf = _load(ckpt)
    weights = bind_weights(spec, layout, buf)
    tensors = load_file(str(ckpt / "model.safetensors"))
    attn = "model.layers.1.self_attn"
    expect_qkv = torch.cat([tensors[f"{attn}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(weights.layers[1].qkv, expect_qkv)
    assert weights.layers[1].qkv_bias is not None
    assert torch.equal(weights.layers[1].qkv_bias,
                       torch.cat([tensors[f"{attn}.{p}_proj.bias"] for p in "qkv"]))
    mlp = "model.layers.0.mlp"
    assert torch.equal(weights.layers[0].gate_up, torch.cat(
        [tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]]))
    assert torch.equal(weights.lm_head, tensors["lm_head.weight"])
    # views, not copies: every tensor lives inside the caller's buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    layer = vars(weights.layers[0]).values()
    for t in (weights.embed_tokens, weights.norm, weights.lm_head, *layer):
        if isinstance(t, torch.Tensor):
            assert lo <= t.data_ptr() < hi


def test_dtype_conversion_and_host_helper(ckpt: Path) -> None:
    spec = ModelSpec.from_dir(ckpt)
    as_f32 = bind_weights(spec, weight_layout(spec, "float32"), _load(ckpt, "float32"))
    as_bf16 = bind_weights(spec, weight_layout(spec), _load(ckpt))
    assert as_f32.dtype == torch.float32 and as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_f32.layers[0].down, as_bf16.layers[0].down.float())
    layout = weight_layout(spec)
    raw = bytearray(layout.total_bytes)
    fill_layout(ckpt, layout, raw)
    assert bytes(raw) == _load(ckpt).numpy().tobytes()


def test_sharded_checkpoint_loads_the_same(ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(_load(sharded), _load(ckpt))


def _rewrite(model_dir: Path, edit: dict[str, torch.Tensor | None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "match"), [
    ({"model.layers.1.self_attn.k_proj.bias": None},
     r"model\.safetensors: model\.layers\.1\.self_attn\.k_proj\.bias: missing tensor"),
    ({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100, dtype=torch.bfloat16)},
     r"down_proj\.weight: wrong shape \[64, 100\], expected \[64, 160\]"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.int32)},
     r"model\.norm\.weight: wrong dtype I32"),
], ids=["missing_tensor", "wrong_shape", "wrong_dtype"])
def test_bad_tensor(ckpt: Path, tmp_path: Path, edit: dict[str, torch.Tensor | None],
                    match: str) -> None:
    bad = _copy(ckpt, tmp_path)
    _rewrite(bad, edit)
    with pytest.raises(CheckpointError, match=match) as info:
        _load(bad)
    assert info.value.path.endswith("model.safetensors")


@pytest.mark.parametrize("damage", ["garbage", "huge_length", "bad_json", "bad_offsets",
                                    "truncated"])
def test_corrupt_safetensors(ckpt: Path, tmp_path: Path, damage: str) -> None:
    bad = _copy(ckpt, tmp_path)
    path = bad / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    if damage == "garbage":
        data = b"\x00\x01not a safetensors file"
    elif damage == "huge_length":
        data = (10**12).to_bytes(8, "little") + data[8:]
    elif damage == "bad_json":
        data = data[:8] + b"x" + data[9:]
    elif damage == "bad_offsets":
        header["model.norm.weight"]["data_offsets"][1] += 2
        raw = json.dumps(header).encode().ljust(length)
        data = data[:8] + raw[:length] + data[8 + length:]
    else:
        data = data[:len(data) // 2]
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as info:
        _load(bad)
    assert info.value.field is not None


def test_missing_files(ckpt: Path, tmp_path: Path) -> None:
    bad = _copy(ckpt, tmp_path)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing file"):
        _load(bad)
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing file"):
        ModelSpec.from_dir(bad)


def test_unsupported_architecture(ckpt: Path, tmp_path: Path) -> None:
    bad = _copy(ckpt, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: architectures: unsupported"):
        ModelSpec.from_dir(bad)


def test_destination_checks(ckpt: Path) -> None:
    spec = ModelSpec.from_dir(ckpt)
    layout = weight_layout(spec)
    with pytest.raises(ValueError, match="needs"):
        load_weights(ckpt, spec, layout, torch.empty(layout.total_bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        load_weights(ckpt, spec, layout, torch.empty(layout.total_bytes, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_digests_are_checked_while_the_files_are_read(ckpt: Path, tmp_path: Path,
                                                       dtype: str | None) -> None:
    """Each file is hashed front to back as its tensors are read (in the file's order,
    whatever the layout's), converted or not, with the bytes no tensor uses (header,
    extras) read for the hash: the digest is the file's; a changed byte is named."""
    extra = _copy(ckpt, tmp_path)
    _rewrite(extra, {"unused.extra": torch.ones(7, dtype=torch.bfloat16)})  # read for the hash
    sharded = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).save_pretrained(
        sharded, max_shard_size="100KB")
    for model_dir in (ckpt, extra, sharded):
        spec = ModelSpec.from_dir(model_dir)
        layout = weight_layout(spec, dtype)
        files = sorted(model_dir.glob("*.safetensors"))
        digests = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
        expected = _load(model_dir, dtype)
        got = torch.empty(layout.total_bytes, dtype=torch.uint8)
        assert fill_layout(model_dir, layout, got, digests=digests) == set(files)
        assert torch.equal(got, expected)
    # one byte of tensor data changed: the same size, a valid header, another digest
    bad = files[-1]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        fill_layout(sharded, layout, got, digests=digests)
    assert str(bad) in str(info.value) and "content differs" in str(info.value)
    fill_layout(sharded, layout, got)  # (no digests asked for: not checked)
