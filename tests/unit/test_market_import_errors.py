"""``aegaeon market add|list|remove`` on the command line: HF directories (single and
sharded), and every bad input refused in one line, exit code 2, the market untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from aegaeon_cli.main import main
from aegaeon_market import load_market
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from market_import_support import Tiny, hf_tensors, write_gguf
from market_import_support import market_tree as _tree
from safetensors.torch import load_file, save_file

Q = GGMLQuantizationType


@pytest.fixture
def market(tmp_path: Path) -> Path:
    """A market holding one imported model, made through the CLI."""
    source = tmp_path / "src" / "base.gguf"
    source.parent.mkdir()
    write_gguf(source, Tiny(), hf_tensors(Tiny()), Q.Q8_0)
    root = tmp_path / "m" / "market"
    assert main(["market", "add", "--market", str(root), "--name", "base", "--dtype", "float32",
                 "--quiet", str(source)]) == 0
    return root


@pytest.fixture
def hf_dir(market: Path, tmp_path: Path) -> Path:
    """A Hugging Face directory (float32), copied out of the market."""
    out = tmp_path / "src" / "hf"
    shutil.copytree(market / "base", out)
    return out


def _refused(market: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
             *needles: str) -> None:
    before = _tree(market)
    assert main(["market", "add", "--market", str(market), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aegaeon market add: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert _tree(market) == before


def _gguf(tmp_path: Path, name: str, tiny: Tiny | None = None, **kwargs: object) -> Path:
    tiny = tiny or Tiny()
    path = tmp_path / "src" / name
    path.parent.mkdir(exist_ok=True)
    write_gguf(path, tiny, hf_tensors(tiny), Q.Q8_0, **kwargs)  # type: ignore[arg-type]
    return path


def test_list_remove_and_replace(market: Path, hf_dir: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["market", "add", "--market", str(market), "--name", "copy", "--dtype",
                 "bfloat16", "--quiet", str(hf_dir)]) == 0
    capsys.readouterr()
    assert main(["market", "list", "--market", str(market)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:5] == ["NAME", "ARCH", "PARAMS", "DTYPE", "BYTES"]
    assert rows[1].split()[:4] == ["base", "LlamaForCausalLM", "0.1M", "float32"]
    assert rows[2].split()[3] == "bfloat16" and rows[2].endswith(str(hf_dir.resolve()))
    copy = load_market(market)[1]
    weights = load_file(str(copy.path / "model.safetensors"))
    original = load_file(str(hf_dir / "model.safetensors"))
    assert all(weights[k].dtype == torch.bfloat16 for k in weights)
    assert all(torch.equal(weights[k], original[k].bfloat16()) for k in original)
    # --replace keeps the model's place and role, swaps its files
    assert main(["market", "add", "--market", str(market), "--name", "copy", "--replace",
                 "--dtype", "float32", "--quiet", str(hf_dir)]) == 0
    assert [e.name for e in load_market(market)] == ["base", "copy"]
    assert load_market(market)[1].dtype == "float32"
    assert main(["market", "remove", "--market", str(market), "copy"]) == 0
    assert [e.name for e in load_market(market)] == ["base"]
    assert not (market / "copy").exists()
    assert sorted(p.name for p in market.iterdir()) == ["base", "market.json"]
    capsys.readouterr()
    before = _tree(market)
    assert main(["market", "remove", "--market", str(market), "nope"]) == 2
    assert "no model named 'nope'" in capsys.readouterr().err
    assert _tree(market) == before


def test_sharded_directory_with_index(market: Path, hf_dir: Path) -> None:
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(hf_dir / shard))
    (hf_dir / "model.safetensors").unlink()
    index = {"weight_map": {n: s for s, ms in shards.items() for n in ms}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["market", "add", "--market", str(market), "--name", "sharded", "--quiet",
                 str(hf_dir)]) == 0
    entry = load_market(market)[1]
    assert entry.dtype == "float32"  # the checkpoint's own
    got = load_file(str(entry.path / "model.safetensors"))
    assert set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)


def test_name_clash_and_bad_names(market: Path, hf_dir: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    _refused(market, capsys, ["--name", "base", str(hf_dir)], "market.json", "'base' exists",
             "--replace")
    _refused(market, capsys, ["--name", "../evil", str(hf_dir)], "--name")
    (market / "stray").mkdir()
    _refused(market, capsys, ["--name", "stray", str(hf_dir)], "stray", "not a model")


def _truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def _wrong_magic(path: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    return path


def _type_id(path: Path, tensor: str, type_id: int) -> Path:
    """Overwrite the GGML type of ``tensor`` in its tensor-info record."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    data[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def _iq2(tmp_path: Path) -> Path:
    """A file with one IQ2_XXS tensor (a type the import refuses)."""
    tiny = Tiny(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=256, layers=1)
    block, size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    blob = np.zeros((tiny.inter, tiny.hidden // block * size), dtype=np.uint8)
    return _gguf(tmp_path, "iq.gguf", tiny, raw={"blk.0.ffn_up.weight": (blob, Q.IQ2_XXS)})


GGUF_CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "truncated": (lambda t: _truncate(_gguf(t, "t.gguf")), ("t.gguf", "truncated")),
    "wrong magic": (lambda t: _wrong_magic(_gguf(t, "m.gguf")), ("m.gguf", "magic")),
    "unknown type id": (lambda t: _type_id(_gguf(t, "u.gguf"), "blk.1.ffn_up.weight", 99),
                        ("u.gguf", "unknown GGML type 99")),
    "unsupported quant type": (_iq2, ("iq.gguf", "blk.0.ffn_up.weight",
                                      "IQ2_XXS is not supported", "Q4_1")),
    "no tokenizer": (lambda t: _gguf(t, "nt.gguf", skip_keys=("tokenizer.ggml.tokens",)),
                     ("nt.gguf", "tokenizer.ggml.model", "missing")),
    "unknown pre-tokenizer": (lambda t: _gguf(t, "p.gguf", pre="tekken"),
                              ("p.gguf", "tokenizer.ggml.pre", "tekken")),
    "shape mismatch": (lambda t: _gguf(t, "s.gguf", Tiny(extra={"llama.feed_forward_length": 96})),
                       ("s.gguf", "blk.0.ffn_gate.weight", "[96, 64]", "[128, 64]")),
    "missing key": (lambda t: _gguf(t, "k.gguf", skip_keys=("llama.block_count",)),
                    ("k.gguf", "llama.block_count", "missing")),
    "fewer layers than tensors": (
        lambda t: _gguf(t, "l.gguf", Tiny(extra={"llama.block_count": 1})),
        ("l.gguf", "blk.1.", "does not account for")),
    "unsupported architecture": (lambda t: _gguf(t, "a.gguf", Tiny(arch="phi3")),
                                 ("a.gguf", "general.architecture", "'phi3'")),
    "rope factors not llama3": (
        lambda t: _gguf(t, "r.gguf", extra_tensors={"rope_freqs.weight": np.full(8, 3.0,
                                                                              np.float32)}),
        ("r.gguf", "rope_freqs.weight", "not llama3")),
    "missing file": (lambda t: t / "src" / "absent.gguf", ("absent.gguf", "missing")),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_bad_gguf_leaves_the_market_unchanged(case: str, market: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    make, needles = GGUF_CASES[case]
    source = make(tmp_path)
    _refused(market, capsys, ["--name", "new", str(source)], *needles)


def _edit_config(key: str, value: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config[key] = value
        (d / "config.json").write_text(json.dumps(config))
    return edit


def _drop_tensor(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))


def _truncate_weights(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:900])


HF_CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), ("tokenizer.json", "missing")),
    "config disagrees with shapes": (
        _edit_config("intermediate_size", 96),
        ("model.safetensors", "model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[96, 64]")),
    "unsupported architecture": (_edit_config("architectures", ["GPT2LMHeadModel"]),
                                 ("config.json", "architectures", "GPT2LMHeadModel")),
    "unsupported rope scaling": (
        _edit_config("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        ("config.json", "rope_scaling.rope_type", "'yarn'")),
    "quantized checkpoint": (_edit_config("quantization_config", {"quant_method": "gptq"}),
                             ("config.json", "quantization_config", "gptq")),
    "missing tensor": (_drop_tensor, ("model.safetensors", "model.layers.1.mlp.down_proj.weight",
                                      "missing")),
    "truncated weights": (_truncate_weights, ("model.safetensors",)),
    "tokenizer larger than the vocabulary": (_edit_config("vocab_size", 300),
                                             ("config.json", "vocab_size")),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_bad_hf_directory_leaves_the_market_unchanged(
        case: str, market: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, needles = HF_CASES[case]
    (hf_dir / "config.json").write_text(  # rope_parameters would shadow rope_scaling
        json.dumps({k: v for k, v in json.loads((hf_dir / "config.json").read_text()).items()
                    if k != "rope_parameters"}))
    edit(hf_dir)
    _refused(market, capsys, ["--name", "new", str(hf_dir)], *needles)


def test_failure_at_commit_undoes_everything(market: Path, hf_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_market import edit

    def broken(root: Path, manifest: object) -> None:
        raise OSError(28, "No space left on device", str(root / "market.json"))

    monkeypatch.setattr(edit, "write_manifest", broken)
    for argv in (["--name", "new"], ["--name", "base", "--replace"]):
        before = _tree(market)
        assert main(["market", "add", "--market", str(market), "--quiet", *argv,
                     str(hf_dir)]) == 2
        assert "No space left on device" in capsys.readouterr().err
        assert _tree(market) == before


def test_a_failed_add_to_a_new_market_leaves_nothing(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = _truncate(_gguf(tmp_path, "bad.gguf"))
    new = tmp_path / "fresh" / "market"
    assert main(["market", "add", "--market", str(new), "--name", "x", "--quiet", str(bad)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert not new.exists()
    assert main(["market", "remove", "--market", str(new), "x"]) == 2
    assert "market.json not found" in capsys.readouterr().err


def test_add_records_each_file_and_verify_checks_them(market: Path, hf_dir: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``market add`` records every file's size and sha256 in market.json; ``market
    verify`` finds a file changed since (one line per bad model, exit code 2) and reads
    an entry written before the records (no ``files``) for its structure alone."""
    assert main(["market", "add", "--market", str(market), "--name", "copy", "--quiet",
                 str(hf_dir)]) == 0
    entry = load_market(market)[1]
    on_disk = sorted(p.name for p in entry.path.iterdir())
    assert [f.name for f in entry.files] == on_disk
    for record in entry.files:
        data = (entry.path / record.name).read_bytes()
        assert (record.size, record.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    capsys.readouterr()
    assert main(["market", "verify", "--market", str(market)]) == 0
    assert capsys.readouterr().out.startswith("2 models as market.json records them")
    # one file cut short, another's content changed at the same size
    weights = entry.path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    base = load_market(market)[0].path / "model.safetensors"
    base.write_bytes(base.read_bytes()[:1000])
    assert main(["market", "verify", "--market", str(market)]) == 2
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["base", "copy"]
    assert f"{base}: 1000 bytes, market.json records" in lines[0]
    assert f"{weights}: content differs from what market.json records" in lines[1]
    assert "2 of 2 models bad" in err
    assert main(["market", "verify", "--market", str(market), "copy"]) == 2
    assert capsys.readouterr().out.splitlines() == lines[1:]
    assert main(["market", "verify", "--market", str(market), "nope"]) == 2
    assert "no model named 'nope'" in capsys.readouterr().err
    # an entry from before the records: checked for what the engine reads
    doc = json.loads((market / "market.json").read_text())
    for model in doc["models"]:
        del model["files"]
    (market / "market.json").write_text(json.dumps(doc))
    assert load_market(market)[1].files == ()
    assert main(["market", "verify", "--market", str(market)]) == 2
    out, err = capsys.readouterr()
    assert [line.split(":")[0] for line in out.splitlines()] == ["base"]  # copy: structure ok
    assert "corrupt safetensors header" in out and "without recorded digests" in err


@pytest.mark.parametrize("files", [[1], {"model.safetensors": {"size": -1, "sha256": "0" * 64}},
                                   {"model.safetensors": {"size": 3, "sha256": "xyz"}}])
def test_a_bad_files_record_names_the_model_and_field(market: Path, files: object) -> None:
    from aegaeon_common.market_index import MarketError

    doc = json.loads((market / "market.json").read_text())
    doc["models"][0]["files"] = files
    (market / "market.json").write_text(json.dumps(doc))
    with pytest.raises(MarketError, match=r"market.json: models: base: files"):
        load_market(market)
