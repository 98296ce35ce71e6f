"""The kernels an engine runs, chosen by measurement per model shape (tuning.py): every
candidate timed, the choice kept per machine and reused, a forced level measuring
nothing, and whatever is chosen computing the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from aegaeon_common.env import read_env
from aegaeon_common.kept import write_first
from aegaeon_engine import Engine, tuning
from aegaeon_engine import native as native_mod
from aegaeon_engine.kernels import NativeOps
from aegaeon_engine.tuning import OPERATIONS, TORCH, KernelChoice
from engine_support import Bound, block_lists, make_checkpoint, prompts_of

LEVELS = native_mod.supported_levels()
needs_native = pytest.mark.skipif(
    not LEVELS or not read_env().native_kernels,
    reason="no native kernels on this CPU (or AEGAEON_NATIVE=0)")


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("AEGAEON_PROFILE_CACHE", raising=False)
    monkeypatch.delenv("AEGAEON_ISA", raising=False)
    native_mod.forget()
    yield tmp_path / "cache"
    native_mod.forget()


def _kept(cache_home: Path) -> list[Path]:
    return sorted((cache_home / "aegaeon" / "profiles").glob("kernels-*.json"))


def test_choice_round_trips_and_reports_each_operation() -> None:
    choice = KernelChoice("avx2", "float32", "torch",
                          {"attention": {"avx2": 3.0, "torch": 2.0}})
    again = KernelChoice.from_json(choice.to_json())
    assert again == choice and again.timings_us == choice.timings_us
    report = choice.report()
    assert list(report) == list(OPERATIONS)
    assert report["attention"] == {"level": "torch", "us": {"avx2": 3.0, "torch": 2.0}}
    assert report["decode_projection"] == {"level": "avx2", "us": {}}
    with pytest.raises(KeyError):
        KernelChoice.from_json(json.dumps({"choice": {"attention": "avx2"}}))


def test_a_candidate_replaces_the_default_only_when_clearly_faster() -> None:
    assert tuning._pick({"avx512": 100.0, "avx2": 97.0}, "avx512") == "avx512"  # noise
    assert tuning._pick({"avx512": 100.0, "avx2": 90.0}, "avx512") == "avx2"
    assert tuning._pick({"float32": 50.0, "bfloat16": 400.0}, "bfloat16") == "float32"


def test_the_first_writer_wins(tmp_path: Path) -> None:
    path = tmp_path / "kept" / "x.json"
    assert write_first(path, "first") == "first"
    assert write_first(path, "second") == "first"  # a later measurement defers to it
    assert path.read_text() == "first"
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary left


@needs_native
def test_measured_once_per_machine_then_kept(tmp_path: Path, cache_home: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "m", "qwen3", seed=1)
    spec = Bound(ckpt, dtype="bfloat16").spec
    choice = Engine().tune(spec, "bfloat16")
    for op in ("decode_projection", "attention"):  # every supported level and torch timed
        assert set(choice.timings_us[op]) == {*LEVELS, TORCH}
        assert getattr(choice, op) in choice.timings_us[op]
        assert all(us > 0 for us in choice.timings_us[op].values())
    assert set(choice.timings_us["prefill_gemm"]) == {"float32", "bfloat16"}
    [kept] = _kept(cache_home)

    def no_measuring(*args: object) -> KernelChoice:
        raise AssertionError("measured again")

    measure = tuning.measure
    monkeypatch.setattr(tuning, "measure", no_measuring)
    assert Engine().tune(spec, "bfloat16") == choice  # another process: the kept file
    assert _kept(cache_home) == [kept]
    kept.write_text("{not json")  # a broken file is measured again, not an error
    monkeypatch.setattr(tuning, "measure", measure)
    assert Engine().tune(spec, "bfloat16").timings_us
    # a choice this CPU cannot run (another machine's file) is measured again too
    kept.write_text(KernelChoice("sve9", "float32", TORCH).to_json())
    assert Engine().tune(spec, "bfloat16").decode_projection in (*LEVELS, TORCH)


@needs_native
def test_a_forced_level_measures_nothing(tmp_path: Path, cache_home: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spec = Bound(make_checkpoint(tmp_path / "m", "llama-gqa", seed=1)).spec
    monkeypatch.setattr(tuning, "measure", lambda *a: pytest.fail("measured"))
    choice = Engine(isa=LEVELS[0]).tune(spec, "float32")
    assert (choice.decode_projection, choice.attention) == (LEVELS[0], LEVELS[0])
    monkeypatch.setenv("AEGAEON_ISA", LEVELS[0])
    native_mod.forget()
    assert Engine().tune(spec, "bfloat16").timings_us == {}
    assert Engine(native=False).tune(spec, "float32") == KernelChoice(TORCH, "float32", TORCH)
    assert not _kept(cache_home)


def _forced_logits(bound: Bound, prompts: list[list[int]], tokens: list[list[int]],
                   blocks: list[list[int]]) -> torch.Tensor:
    """Logits of the prefill and of each decode step fed ``tokens`` (teacher forcing)."""
    from aegaeon_engine import DecodeSeq

    rows = [torch.stack([bound.engine.prefill(p, b) for p, b in zip(prompts, blocks,
                                                                    strict=True)])]
    for k in range(len(tokens[0]) - 1):
        seqs = [DecodeSeq(t[k], len(p) + k, b) for p, t, b in zip(prompts, tokens, blocks,
                                                                  strict=True)]
        rows.append(bound.engine.decode(seqs))
    return torch.stack(rows)


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_choice_computes_the_same_logits(tmp_path: Path, cache_home: Path,
                                               dtype: str) -> None:
    """A model bound under a chosen kernel set runs it (``isa``, ``compute_dtype``):
    float32 logits equal the default kernels' up to sum order; bfloat16 ones no farther
    from float32's than the torch path's bfloat16 on this CPU."""
    ckpt = make_checkpoint(tmp_path / "m", "qwen3", seed=2)
    prompts, blocks = prompts_of((5, 19, 33), seed=3), block_lists(3, 4)
    exact = Bound(ckpt, dtype="float32", engine=Engine(native=False))
    tokens = exact.greedy(prompts, 6, blocks)
    want = _forced_logits(exact, prompts, tokens, blocks)
    torch_path = _forced_logits(Bound(ckpt, dtype=dtype, engine=Engine(native=False)),
                                prompts, tokens, blocks)
    prefill = "bfloat16" if dtype == "bfloat16" else "float32"
    for choice in (KernelChoice(TORCH, prefill, TORCH),
                   KernelChoice(LEVELS[0], "float32", LEVELS[-1])):
        engine = Engine()
        engine._choices[tuning.shape_key(exact.spec, getattr(torch, dtype))] = choice
        bound = Bound(ckpt, dtype=dtype, engine=engine)  # as tune() would have measured
        assert engine.kernel_choice == choice and engine.isa == choice.decode_projection
        assert engine.attention.isa == (None if choice.attention == TORCH else choice.attention)
        assert isinstance(engine.ops, NativeOps)
        if dtype == "bfloat16":
            assert engine.compute_dtype == choice.prefill_gemm
        got = _forced_logits(bound, prompts, tokens, blocks)
        if dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        else:
            err, torch_err = (got - want).abs().max(), (torch_path - want).abs().max()
            assert err <= 1.5 * torch_err + 0.02, (choice, err, torch_err)
