"""LoRA adapters in a market: ``aegaeon market add --adapter/--random-adapter``, ``list``,
``remove``, and the config that serves them.

A PEFT adapter made by ``peft`` is checked against its base and stored as it
came (the market grows by its bytes); ``market list`` shows its base; a base
with adapters is neither removed nor replaced; a random adapter is seeded. A bad
adapter (wrong shapes, an unknown base, a missing file, a bad config field) is
one line naming what is wrong, exit code 2, and the market is unchanged. A
market with adapters configures them with their bases and leaves them out of
the serving dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from aegaeon_common.config import ConfigError, config_from_dict
from aegaeon_common.market_index import read_manifest
from aegaeon_market.adapters import add_adapter, add_random_adapter
from engine_support import make_checkpoint
from lora_support import lora_market, make_peft_adapter

BASE = "base"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("madapt") / "ckpt", "llama-gqa", seed=1)


@pytest.fixture(scope="module")
def peft_dir(base_dir: Path) -> Path:
    return make_peft_adapter(base_dir, base_dir.parent / "peft", 8, ("q_proj", "v_proj")).path


@pytest.fixture
def market(base_dir: Path, tmp_path: Path) -> Path:
    """A market of the checkpoint (linked in: it has no tokenizer to import)."""
    return lora_market(tmp_path / "market", {BASE: base_dir})


def _cli(*argv: str) -> int:
    from aegaeon_cli.main import main

    return main(list(argv))


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def test_add_stores_the_peft_adapter_as_it_came(market: Path, peft_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    before = sum(len(b) for b in _files(market).values())
    assert _cli("market", "add", "--market", str(market), "--name", "tuned", "--adapter",
                str(peft_dir), "--base", BASE) == 0
    assert "LoRA adapter of base" in capsys.readouterr().out
    entry = next(e for e in read_manifest(market).entries if e.name == "tuned")
    assert entry.base == BASE and entry.arch == "LoRA" and entry.adapter
    assert entry.params == 2 * 8 * (64 + 64 + 64 + 32)  # 2 layers, q and v: A and B
    stored = _files(market / "tuned")
    assert set(stored) == {"adapter_config.json", "adapter_model.safetensors"}
    assert stored["adapter_model.safetensors"] == (
        peft_dir / "adapter_model.safetensors").read_bytes()
    after = sum(len(b) for b in _files(market).values())
    assert after - before == sum(len(b) for b in stored.values()) + (
        len((market / "market.json").read_bytes()) - len(_manifest_before(market)))
    assert _cli("market", "list", "--market", str(market)) == 0
    rows = {r.split()[0]: r.split() for r in capsys.readouterr().out.splitlines()[1:]}
    assert rows["tuned"][1] == "LoRA" and rows["tuned"][5] == BASE and rows[BASE][5] == "-"


def _manifest_before(market: Path) -> bytes:
    """market.json without the adapters (what it was before they were added)."""
    doc = json.loads((market / "market.json").read_text())
    doc["models"] = [m for m in doc["models"] if "base" not in m]
    return (json.dumps(doc, indent=2) + "\n").encode()


def test_a_base_with_adapters_is_not_removed_or_replaced(
        market: Path, peft_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    add_adapter(market, peft_dir, "tuned", BASE)
    before = _files(market)
    assert _cli("market", "remove", "--market", str(market), BASE) == 2
    err = capsys.readouterr().err
    assert "cannot remove 'base'" in err and "tuned" in err and err.count("\n") == 1
    assert _cli("market", "add", "--market", str(market), "--name", BASE, "--replace",
                "--random", "qwen2.5-0.5b") == 2
    assert "cannot replace 'base'" in capsys.readouterr().err
    assert _files(market) == before
    assert _cli("market", "remove", "--market", str(market), "tuned") == 0
    assert [e.name for e in read_manifest(market).entries] == [BASE]


def test_random_adapters_are_seeded(market: Path) -> None:
    one = add_random_adapter(market, "r1", BASE, 16)
    two = add_random_adapter(market, "r2", BASE, 16, seed=0)
    again = add_random_adapter(market, "r3", BASE, 16, seed=0)
    weights = "adapter_model.safetensors"
    assert (two.path / weights).read_bytes() == (again.path / weights).read_bytes()
    assert (one.path / weights).read_bytes() != (two.path / weights).read_bytes()  # by name
    assert one.params == 2 * 16 * (4 * 64 + 64 + 32 + 32 + 64)  # q, k, v, o of 2 layers


@pytest.mark.parametrize("case", ["wrong-shapes", "unknown-base", "missing-file", "bad-rank",
                                  "bad-target", "rank-too-high"])
def test_a_bad_adapter_is_one_line_and_the_market_is_unchanged(
        case: str, market: Path, peft_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "adapter"
    shutil.copytree(peft_dir, source)
    base, named = BASE, ""
    argv = ["--adapter", str(source)]
    if case == "wrong-shapes":
        other = make_checkpoint(tmp_path / "wide", "llama-gqa", hidden_size=96)
        make_peft_adapter(other, source, 8, ("q_proj",))
        named = "wrong shape"
    elif case == "unknown-base":
        base, named = "no-such-base", "no-such-base"
    elif case == "missing-file":
        (source / "adapter_model.safetensors").unlink()
        named = "adapter_model.safetensors: missing file"
    elif case == "bad-rank":
        doc = json.loads((source / "adapter_config.json").read_text())
        doc["r"] = 4  # the tensors say 8
        (source / "adapter_config.json").write_text(json.dumps(doc))
        named = "wrong shape"
    elif case == "bad-target":
        argv, named = ["--random-adapter", "--rank", "8", "--targets", "lm_head"], "lm_head"
    else:
        argv, named = ["--random-adapter", "--rank", "65"], "--rank 65"
    before = _files(market)
    capsys.readouterr()  # what making the adapter printed
    code = _cli("market", "add", "--market", str(market), "--name", "bad", "--base", base, *argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("aegaeon market add: error: ") and err.count("\n") == 1
    assert named in err, err
    assert _files(market) == before


def test_adapter_options_are_checked_before_anything_is_done(market: Path, peft_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:  # fmt: skip
    for argv, said in ((["--adapter", str(peft_dir)], "--base BASE is needed"),
                       (["--random-adapter", "--base", BASE], "--rank R is needed"),
                       (["--adapter", str(peft_dir), "--base", BASE, "--dtype", "bfloat16"],
                        "--dtype is not for adapters"),
                       (["--random", "llama-3.2-1b", "--base", BASE], "--base is for")):
        code = _cli("market", "add", "--market", str(market), "--name", "x", *argv)
        assert code == 2 and said in capsys.readouterr().err, argv
    assert [e.name for e in read_manifest(market).entries] == [BASE]


def test_a_market_with_adapters_serves_them_with_their_bases(market: Path,
                                                             peft_dir: Path) -> None:
    add_adapter(market, peft_dir, "tuned", BASE)
    add_random_adapter(market, "bf16", BASE, 8)  # stored in the base's dtype: float32
    config = config_from_dict({"market": str(market)})
    by_name = {m.name: m for m in config.models}
    assert by_name["tuned"].base == BASE and by_name[BASE].base is None
    assert config.unit_of("tuned") == BASE and config.unit_of(BASE) == BASE
    assert config.dtype == "float32"  # the base's: adapters do not decide it
    with pytest.raises(ConfigError, match=r"models\[1\]\.base"):
        config_from_dict({"models": [{"name": BASE, "path": str(market / BASE)},
                                     {"name": "tuned", "path": str(market / "tuned"),
                                      "base": "nope"}]})
