"""aegaeon market: layout, determinism, HF compatibility, tokenizers, CLI."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path

import pytest
from aegaeon_market import (
    MarketEntry,
    MarketError,
    create_market,
    default_bench_model,
    ensure_market,
    load_market,
)
from aegaeon_market.plan import plan_market

FOUR_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"}
TEXT = "Hello, wörld! Crème brûlée costs €12.50 — naïve 日本語 ☕ 🙂\n\tdef f(x): return x * 42"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "A joke?"}]


@pytest.fixture(scope="module")
def market4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first four models of the ladder (one per variant, ~60M parameters)."""
    out = tmp_path_factory.mktemp("market") / "m"
    create_market(out, num_models=4, seed=0, progress=False)
    return out


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _config(entry: MarketEntry) -> dict[str, object]:
    return json.loads((entry.path / "config.json").read_text())  # type: ignore[no-any-return]


def test_layout_and_manifest(market4: Path) -> None:
    entries = load_market(market4)
    raw = json.loads((market4 / "market.json").read_text())
    assert raw["seed"] == 0 and len(raw["models"]) == 4 and raw["generator"]
    assert {e.arch for e in entries} == FOUR_ARCHS
    for entry, item in zip(entries, raw["models"], strict=True):
        assert item["path"] == entry.name and entry.path == market4.resolve() / entry.name
        assert {p.name for p in entry.path.iterdir()} == MODEL_FILES
        assert entry.dtype == "bfloat16" and _config(entry)["torch_dtype"] == "bfloat16"
    assert default_bench_model(market4).arch == "Qwen3ForCausalLM"


def test_same_seed_same_bytes_other_seed_other_weights(market4: Path, tmp_path: Path) -> None:
    create_market(tmp_path / "again", num_models=4, seed=0, progress=False)
    assert _hashes(tmp_path / "again") == _hashes(market4)
    create_market(tmp_path / "seed1", num_models=1, seed=1, progress=False)
    name = load_market(tmp_path / "seed1")[0].name
    other, ours = _hashes(tmp_path / "seed1"), _hashes(market4)
    assert other[f"{name}/model.safetensors"] != ours[f"{name}/model.safetensors"]
    assert other[f"{name}/tokenizer.json"] == ours[f"{name}/tokenizer.json"]


def test_kv_shapes_differ(market4: Path) -> None:
    shapes = set()
    for entry in load_market(market4):
        cfg = _config(entry)
        shapes.add((cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]))
    assert len(shapes) == 4


def test_plan_ladder_cycles_and_profiles() -> None:
    default = plan_market(8, seed=0)
    # other rooms' tests name these models: keep the names stable
    assert [p.name for p in default] == ["llama-gqa-5m", "mistral-11m", "qwen2-19m", "qwen3-28m",
                                         "llama-46m", "mistral-63m", "qwen2-77m", "qwen3-103m"]
    assert 4e6 < default[0].params < 6e6 and 90e6 < default[-1].params < 110e6
    assert [p.role for p in default].count("bench") == 1
    big = plan_market(20, seed=0)
    assert len({p.name for p in big}) == 20 and big[8].name == "llama-gqa-5m-b"
    assert big[16].name.endswith("-c") and len({p.seed for p in big}) == 20
    small = plan_market(7, seed=0, profile="small")
    assert {p.recipe.stem for p in small} == {"llama-gqa", "mistral", "qwen2"}
    assert [p.role for p in small].count("bench") == 1
    for bad in ({"num_models": 0, "seed": 0}, {"num_models": 2, "seed": 0, "profile": "huge"}):
        with pytest.raises(MarketError):
            plan_market(**bad)


def test_transformers_loads_every_model_without_missing_keys(market4: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    for entry in load_market(market4):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            entry.path, output_loading_info=True, dtype=torch.float32)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        assert type(model).__name__ == entry.arch
        assert sum(p.numel() for p in model.parameters()) == entry.params
        tok = transformers.AutoTokenizer.from_pretrained(entry.path)
        assert len(tok) == _config(entry)["vocab_size"]
        with torch.no_grad():
            logits = model(tok(TEXT, return_tensors="pt").input_ids).logits[0].float()
        top2 = logits.topk(2, dim=-1).values
        # far from ties, so greedy comparisons with our engine are meaningful
        assert 3.0 < logits.std(-1).mean().item() < 10.0
        assert (top2[:, 0] - top2[:, 1]).median().item() > 0.2


def test_tokenizers_round_trip_and_agree_with_transformers(market4: Path) -> None:
    from tokenizers import Tokenizer

    transformers = pytest.importorskip("transformers")
    text = unicodedata.normalize("NFC", TEXT)  # Qwen tokenizers normalise to NFC
    for entry in load_market(market4):
        raw = Tokenizer.from_file(str(entry.path / "tokenizer.json"))
        ids = raw.encode(text).ids
        assert raw.decode(ids, skip_special_tokens=True) == text
        assert len(ids) < len(text.encode()) * 0.8  # merges learned, not bytes
        hf = transformers.AutoTokenizer.from_pretrained(entry.path)
        assert hf(text).input_ids == ids, entry.name
        starts_with_bos = ids[0] == hf.bos_token_id
        assert starts_with_bos == (entry.arch in ("LlamaForCausalLM", "MistralForCausalLM"))


@pytest.mark.parametrize(("arch", "markers"), [
    ("LlamaForCausalLM", ["<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
                          "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"]),
    ("MistralForCausalLM", ["<s>[INST] Be brief.\n\nHi there! [/INST] Hello.</s>[INST]"]),
    ("Qwen2ForCausalLM", ["<|im_start|>system\nBe brief.<|im_end|>\n",
                          "<|im_start|>assistant\n"]),
    ("Qwen3ForCausalLM", ["<|im_start|>user\nA joke?<|im_end|>\n<|im_start|>assistant\n"]),
])
def test_chat_templates_render(market4: Path, arch: str, markers: list[str]) -> None:
    transformers = pytest.importorskip("transformers")
    entry = next(e for e in load_market(market4) if e.arch == arch)
    tok = transformers.AutoTokenizer.from_pretrained(entry.path)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for marker in markers:
        assert marker in text
    gen = json.loads((entry.path / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    stops = eos if isinstance(eos, list) else [eos]
    # the token that ends an assistant turn stops generation
    assert tok.convert_tokens_to_ids(tok.eos_token) in stops


def test_ensure_market_reuses_current_and_rebuilds_stale(market4: Path, tmp_path: Path) -> None:
    # a market from this code is kept whatever it was made with
    assert ensure_market(market4, num_models=3, progress=False) == load_market(market4)
    root = tmp_path / "fresh"
    built = ensure_market(root, num_models=2, profile="small", progress=False)
    assert [e.name for e in built] == ["llama-gqa-5m", "mistral-11m"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh"]  # nothing left aside
    before = _hashes(root)
    # a market from other market code is rebuilt with the arguments it records
    manifest = json.loads((root / "market.json").read_text())
    manifest["generator"] = "older-code"
    (root / "market.json").write_text(json.dumps(manifest))
    (root / "mistral-11m" / "model.safetensors").write_bytes(b"stale")
    assert ensure_market(root, progress=False) == built
    assert _hashes(root) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(MarketError, match=r"no market\.json"):
        ensure_market(tmp_path / "mine", progress=False)


def test_cli_create_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_cli.main import main

    out = tmp_path / "cli"
    assert main(["market", "create", "--out", str(out), "--models", "1", "--dtype", "float32",
                 "--random-only", "--quiet"]) == 0
    (entry,) = load_market(out)
    assert entry.dtype == "float32" and _config(entry)["dtype"] == "float32"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    assert main(["market", "create", "--out", str(tmp_path / "junk"), "--random-only",
                 "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "junk" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit) as exc:
        main(["market", "create", "--models", "0"])
    assert exc.value.code == 2


def test_corpus_is_reproducible() -> None:
    from aegaeon_market import corpus_path
    from aegaeon_market.corpus_gen import generate

    assert generate() == corpus_path().read_text(encoding="utf-8")
