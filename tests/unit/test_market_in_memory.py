"""``aegaeon market add --random PRESET --in-memory``: entries whose weights are generated at
load, never written.

The entry records its preset, dtype and a seed of its own; loading it twice gives the
same bytes, another seed other bytes, and the bytes are those its written twin (the
same preset, dtype and seed on disk) loads: the generator and the writer share one
sequence. Real presets are added at their released sizes (the entry is a few small
files); the bytes are checked at toy sizes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from aegaeon_cli.main import main
from aegaeon_common.market_index import MarketError
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.layout import weight_layout
from aegaeon_engine.loader import checkpoint_index, fill_layout
from aegaeon_engine.random_weights import RANDOM_WEIGHTS_FILE, RandomWeights
from aegaeon_engine.spec import FP8, ModelSpec
from aegaeon_market import load_market
from aegaeon_market.edit import add_random
from aegaeon_market.preset_writer import write_preset
from aegaeon_market.presets import PRESETS, Preset

TOY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
       "intermediate_size": 96}
DTYPES = ("bfloat16", FP8)


def toy(name: str) -> Preset:
    preset = PRESETS[name]
    return replace(preset, recipe=replace(preset.recipe, **TOY))


def region(model_dir: Path, dtype: str = "bfloat16") -> torch.Tensor:
    """What the Model Cache puts in a region for ``model_dir`` served in ``dtype``."""
    layout = weight_layout(ModelSpec.from_dir(model_dir), dtype)
    out = torch.full((layout.total_bytes,), 0xA5, dtype=torch.uint8)  # not zeroed memory
    fill_layout(model_dir, layout, out)
    return out


def test_cli_adds_real_presets_without_weights(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    market = tmp_path / "market"
    for name, preset in (("a", "llama-3.1-8b"), ("b", "llama-3.1-8b"), ("c", "qwen3-8b")):
        argv = ["market", "add", "--market", str(market), "--random", preset, "--name", name,
                "--in-memory", "--quiet", *(["--dtype", "fp8"] if name != "c" else [])]
        assert main(argv) == 0
    entries = {e.name: e for e in load_market(market)}
    seeds = {n: e.in_memory.seed for n, e in entries.items() if e.in_memory is not None}
    assert len(seeds) == 3 and len(set(seeds.values())) == 3  # a seed of its own each
    assert entries["a"].dtype == FP8 and entries["c"].dtype == "bfloat16"
    assert entries["a"].params == PRESETS["llama-3.1-8b"].params
    raw = {m["name"]: m for m in json.loads((market / "market.json").read_text())["models"]}
    assert raw["a"]["in_memory"] == {"preset": "llama-3.1-8b", "seed": seeds["a"]}
    for name, entry in entries.items():  # never on disk: a few small files, no weights
        files = sorted(p.name for p in entry.path.iterdir())
        assert RANDOM_WEIGHTS_FILE in files and not any(f.endswith(".safetensors")
                                                        for f in files), files
        assert sum(p.stat().st_size for p in entry.path.iterdir()) < 32 << 20
        recipe = RandomWeights.from_dir(entry.path)
        assert recipe is not None and recipe.seed == seeds[name]
        assert (recipe.preset, recipe.dtype) == (entry.in_memory.preset, entry.dtype)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match="in-memory entry"):
            checkpoint_index(entry.path)  # nothing to read: the loader generates it
    capsys.readouterr()
    assert main(["market", "list", "--market", str(market)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["a"].endswith(f"random (preset llama-3.1-8b), in memory, seed {seeds['a']}")
    assert rows["c"].endswith(f"in memory, seed {seeds['c']}")


def test_seeds_stay_distinct_and_a_taken_one_is_refused(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:  # fmt: skip
    market = tmp_path / "market"
    preset = toy("llama-3.2-1b")
    first = add_random(market, preset, "a", in_memory=True, progress=False)
    second = add_random(market, preset, "b", in_memory=True, progress=False, seed=7)
    third = add_random(market, preset, "c", in_memory=True, progress=False)
    assert [e.in_memory.seed for e in (first, second, third)] == [1, 7, 8]  # type: ignore[union-attr]
    before = (market / "market.json").read_text()
    with pytest.raises(MarketError, match="model 'b' has it"):
        add_random(market, preset, "d", in_memory=True, progress=False, seed=7)
    again = add_random(market, preset, "b", in_memory=True, progress=False, seed=7,
                       replace_existing=True)  # its own seed, replaced: fine
    assert again.in_memory is not None and again.in_memory.seed == 7
    assert json.loads((market / "market.json").read_text()) == json.loads(before)
    assert not (market / "d").exists()
    with pytest.raises(MarketError, match="only an --in-memory entry"):
        add_random(market, preset, "e", progress=False, seed=3)
    # the CLI: --in-memory without --random is one line, exit 2
    assert main(["market", "add", "--market", str(market), "--name", "x", "--in-memory",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--in-memory and --seed go with --random" in err[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_equal_across_loads_distinct_across_seeds_and_as_written(
        tmp_path: Path, dtype: str) -> None:
    market = tmp_path / "market"
    preset = toy("llama-3.1-8b")
    a = add_random(market, preset, "a", dtype, in_memory=True, progress=False, seed=5)
    b = add_random(market, preset, "b", dtype, in_memory=True, progress=False, seed=6)
    first, again = region(a.path), region(a.path)
    assert torch.equal(first, again)  # the same bytes on every load
    other = region(b.path)
    assert first.numel() == other.numel()
    assert (first != other).float().mean() > 0.5  # another seed: other weights
    twin = tmp_path / "twin"  # the same preset, dtype and seed, written to disk
    write_preset(preset, twin, dtype, seed=5)
    assert torch.equal(region(twin), first)
    if dtype == "bfloat16":  # served in another dtype: what its twin converts to
        assert torch.equal(region(twin, "float32"), region(a.path, "float32"))


def test_seed_zero_is_what_random_presets_always_wrote(tmp_path: Path) -> None:
    preset = toy("qwen2.5-0.5b")
    write_preset(preset, tmp_path / "old", "bfloat16")  # seed 0: the written presets
    add_random(tmp_path / "market", preset, "z", in_memory=True, progress=False, seed=0)
    assert torch.equal(region(tmp_path / "old"), region(tmp_path / "market" / "z"))


def test_generated_models_serve(tmp_path: Path) -> None:
    """An in-memory entry is a model: the engine loads and runs it as any other."""
    from aegaeon_engine.llm import LLM
    from aegaeon_engine.sampling import SamplingParams

    entry = add_random(tmp_path / "market", toy("llama-3.2-1b"), "a", in_memory=True,
                       progress=False)  # fmt: skip
    llm = LLM(entry.path, dtype="float32")
    tokens = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(tokens) == 4


@pytest.mark.parametrize("broken,field", [
    ("[]", None), ('{"format": 2}', "format"),
    ('{"format": 1, "preset": "x", "dtype": "int4", "seed": 1, "token_id_ranges": []}', "dtype"),
    ('{"format": 1, "preset": "x", "dtype": "bfloat16", "seed": -1, "token_id_ranges": []}',
     "seed"),
    ('{"format": 1, "preset": "x", "dtype": "bfloat16", "seed": 1, "token_id_ranges": [[5]]}',
     "token_id_ranges"),
])  # fmt: skip
def test_a_broken_recipe_names_its_file_and_field(tmp_path: Path, broken: str,
                                                  field: str | None) -> None:
    entry = add_random(tmp_path / "market", toy("llama-3.2-1b"), "a", in_memory=True,
                       progress=False)  # fmt: skip
    (entry.path / RANDOM_WEIGHTS_FILE).write_text(broken)
    with pytest.raises(CheckpointError) as info:
        region(entry.path)
    assert str(entry.path / RANDOM_WEIGHTS_FILE) in str(info.value)
    assert info.value.field == field


def test_its_files_are_recorded_so_a_changed_recipe_is_caught(tmp_path: Path) -> None:
    """An in-memory entry's files (config, tokenizer, ``random-weights.json``) are in
    ``market.json``'s records like any entry's: a recipe edited afterwards no longer
    matches (what ``market verify`` and the cachemgr check)."""
    from aegaeon_common.market_files import digest_problem

    entry = add_random(tmp_path / "market", toy("llama-3.2-1b"), "a", in_memory=True,
                       progress=False)  # fmt: skip
    (listed,) = load_market(tmp_path / "market")
    assert RANDOM_WEIGHTS_FILE in {f.name for f in listed.files}
    assert digest_problem(entry.path, listed.files) is None
    recipe = entry.path / RANDOM_WEIGHTS_FILE
    recipe.write_text(recipe.read_text().replace('"seed": 1', '"seed": 2'))
    problem = digest_problem(entry.path, listed.files)
    assert problem is not None and str(recipe) in problem
