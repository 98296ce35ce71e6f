"""``aegaeon bench switch`` and ``aegaeon bench engine`` on a market holding models
transformers cannot read as they are (issue 36): a GGUF import with its Q4_1 blocks kept
and an FP8 model, beside a float one, as the default market holds a ``-q4`` model.

Each command prints its JSON; transformers loads the two quantized models from their
weights dequantized (`aegaeon_market.readable`) and says so. Structure, not speed:
minimal repetitions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from aegaeon_cli.main import main
from aegaeon_common.market_index import read_manifest
from aegaeon_market.edit import add_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from market_import_support import Tiny, hf_tensors, write_gguf

Q4, FP8, FLOAT = "tiny-q4", "tiny-fp8", "tiny-bf16"


@pytest.fixture(scope="module")
def market(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model three times: kept in Q4_1 blocks (the GGUF file's default import),
    FP8 (made from the Q4_1 model's dequantized weights) and bfloat16."""
    from gguf import GGMLQuantizationType

    tmp = tmp_path_factory.mktemp("quantized-market")
    tiny = Tiny(tied=False)
    source = tmp / "tiny.Q4_1.gguf"
    write_gguf(source, tiny, hf_tensors(tiny), GGMLQuantizationType.Q4_1)
    root = tmp / "market"
    add_model(root, source, Q4, progress=False)
    add_model(root, root / Q4, FP8, "fp8", progress=False)
    add_model(root, source, FLOAT, "bfloat16", progress=False)
    dtypes = {e.name: e.dtype for e in read_manifest(root).entries}
    assert dtypes == {Q4: "q4_1", FP8: "float8_e4m3fn", FLOAT: "bfloat16"}
    return root


def _json(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    value = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(value, dict)
    return value


def test_switch_bench_loads_every_model_in_transformers(
        market: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "bench", "switch", "--market", str(market), "--repeats", "1", "--switch-repeats", "1",
        "--slice-ms", "20", "--kv-ops", "40", "--cold-repeats", "1", "--context", "32",
        "--no-vllm", "--json",
    ])  # fmt: skip
    assert code == 0
    rows = _json(capsys)["models"]
    assert isinstance(rows, dict) and set(rows) == {Q4, FP8, FLOAT}
    for name, row in rows.items():
        assert row["transformers_s"] > 0 and row["cold_worker_s"] > 0, name
    assert "transformers_weights" not in rows[FLOAT]
    assert rows[Q4]["transformers_weights"].startswith("dequantized to bfloat16: q4_1 GGUF")
    assert rows[FP8]["transformers_weights"].startswith("dequantized to bfloat16: FP8")


@pytest.mark.parametrize("model", [Q4, FP8])
def test_engine_bench_runs_transformers_on_the_dequantized_weights(
        market: Path, model: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "bench", "engine", "--market", str(market), "--model", model, "--cpus", "none",
        "--repeats", "1", "--prompt-len", "16", "--new-tokens", "8", "--no-vllm",
        "--no-llamacpp", "--json",
    ])  # fmt: skip
    assert code == 0
    result = _json(capsys)
    assert result["model"] == str(market / model)
    for engine in ("ours", "transformers"):
        row = result[engine]
        assert isinstance(row, dict) and all(v > 0 for v in row.values()), engine
    assert str(result["transformers_weights"]).startswith("dequantized to bfloat16")
    if model == Q4:  # 8-bit activations against transformers' float ones: no equality asked
        assert result["greedy_match"] is None and "8-bit activations" in str(
            result["greedy_match_note"])
    else:  # FP8 on the CPU is its dequantized weights: the same tokens in float32
        assert result["greedy_match"] is True


def test_quant_bench_measures_ours_against_the_dequantized_weights(
        market: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = market.parent / "tiny.Q4_1.gguf"
    code = main(["bench", "quant", "--gguf", str(gguf), "--prompts", "3", "--prompt-len", "8",
                 "--new-tokens", "6", "--no-llamacpp", "--json"])
    assert code == 0
    result = _json(capsys)
    files = result["files"]
    assert isinstance(files, list) and len(files) == 1
    entry = files[0]
    assert entry["quantization"]["linear"] == "q4_1"
    assert set(entry["pairs"]) == {"ours_float32_vs_dequantized", "ours_bfloat16_vs_dequantized"}
    for pair in entry["pairs"].values():
        assert pair["positions"] == 3 * 6
        assert 0.0 <= pair["top1_agreement"] <= 1.0
        assert pair["logprob_drift_max"] >= pair["logprob_drift_p99"] >= 0.0
    assert set(entry["answers"]) == {"dequantized", "ours_float32", "ours_bfloat16"}
    assert "llamacpp_minus_ours_top1" not in entry


def test_quant_bench_refuses_a_file_without_kept_blocks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = Tiny()
    source = tmp_path / "tiny.F32.gguf"
    write_gguf(source, tiny, hf_tensors(tiny))
    assert main(["bench", "quant", "--gguf", str(source), "--no-llamacpp"]) == 2
    assert "not Q8_0, Q4_0 or Q4_1" in capsys.readouterr().err
