"""The engine bench's peers (vLLM, llama.cpp) when they are absent or fail: null numbers and a
reason, never an error of the bench; their numbers and ratios when they ran (no engine runs
here)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aegaeon_bench.engine import bench as engine_bench
from aegaeon_bench.engine import peers as engine_peers
from aegaeon_bench.engine.peers import LLAMACPP, peer_python


def _args(**kwargs: Any) -> argparse.Namespace:
    base = {"no_vllm": True, "vllm_python": None, "no_llamacpp": False,
            "llamacpp_python": None, "llamacpp_gguf": None, "threads": 1, "new_tokens": 4,
            "device": "cpu"}
    return argparse.Namespace(**{**base, **kwargs})


def _result(tmp_path: Path) -> dict[str, Any]:
    return {"model": str(tmp_path / "model"), "dtype": "bfloat16", "cpus": "0"}


def test_missing_interpreter_is_null_with_a_reason(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    result = _result(tmp_path)
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    workers = engine_bench._start_peers(_args(llamacpp_python=missing), result, [[1, 2]],
                                        tmp_path)
    assert workers == {}
    assert missing in result["llamacpp_error"]
    assert "llamacpp unavailable" in capsys.readouterr().err


def test_not_installed_names_the_install_script(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    absent = replace(LLAMACPP, default_python=tmp_path / "absent" / "python",
                     module="no_such_module_here")
    monkeypatch.setattr(engine_peers, "LLAMACPP", absent)
    result = _result(tmp_path)
    assert peer_python(absent, None, result) is None
    assert "scripts/install-llamacpp" in result["llamacpp_error"]
    assert engine_bench._start_peers(_args(), result, [[1, 2]], tmp_path) == {}


def test_default_interpreter_is_the_install_scripts(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    peer = replace(LLAMACPP, default_python=python)
    assert peer_python(peer, None, {}) == str(python)
    assert peer_python(peer, sys.executable, {}) == sys.executable  # given wins


def test_disabled_peers_start_nothing_and_say_nothing(tmp_path: Path) -> None:
    result = _result(tmp_path)
    assert engine_bench._start_peers(_args(no_llamacpp=True), result, [[1]], tmp_path) == {}
    assert not any(key.endswith("_error") for key in result)


def test_no_cpu_peer_beside_ours_on_a_gpu(tmp_path: Path) -> None:
    result = _result(tmp_path)
    args = _args(llamacpp_python=sys.executable, device="cuda:0")
    assert engine_bench._start_peers(args, result, [[1]], tmp_path) == {}
    assert "cuda:0" in result["llamacpp_error"]


def test_unwritable_checkpoint_is_null(tmp_path: Path) -> None:
    result = _result(tmp_path)  # tmp_path/model holds no checkpoint
    workers = engine_bench._start_peers(_args(llamacpp_python=sys.executable), result,
                                        [[1]], tmp_path)
    assert workers == {}
    assert "no GGUF file" in result["llamacpp_error"]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None,
                    reason="this interpreter has llama_cpp")
def test_a_peer_that_dies_at_start_is_null(tmp_path: Path) -> None:
    """An interpreter that runs but cannot import llama_cpp: the worker's stderr is the
    reason, after the GGUF file was written."""
    from aegaeon_market.edit import add_model
    from market_import_support import Tiny, hf_tensors, write_gguf

    source = tmp_path / "tiny.gguf"
    write_gguf(source, Tiny(), hf_tensors(Tiny()))
    entry = add_model(tmp_path / "market", source, "tiny", "bfloat16", progress=False)
    result = {**_result(tmp_path), "model": str(entry.path)}
    workers = engine_bench._start_peers(_args(llamacpp_python=sys.executable), result,
                                        [[1, 2]], tmp_path)
    assert workers == {}
    assert "llama_cpp" in result["llamacpp_error"]  # ModuleNotFoundError, from its stderr
    assert (tmp_path / "tiny-bfloat16.gguf").is_file()


def test_peer_numbers_ratios_and_nulls() -> None:
    ours_tokens = [[1, 2, 3], [4, 5, 6]]
    result: dict[str, Any] = {
        "ours": {"prefill_tok_s": 200.0, "decode_tok_s_b1": 50.0, "decode_tok_s_b8": 300.0},
        "vllm": None, "llamacpp": None}
    runs = [{"prefill_tok_s": p, "decode_tok_s_b1": 40.0, "decode_tok_s_b8": 150.0,
             "tokens_b8": [[1, 2, 3], [4, 9, 6]]} for p in (100.0, 400.0, 250.0)]
    engine_bench._peer_results(result, {"llamacpp": runs}, ours_tokens)
    assert result["vllm"] is None and result["ours_over_vllm"] is None
    assert result["llamacpp"] == {"prefill_tok_s": 250.0, "decode_tok_s_b1": 40.0,
                                  "decode_tok_s_b8": 150.0}  # medians
    assert result["ours_over_llamacpp"] == {"prefill_tok_s": 0.8, "decode_tok_s_b1": 1.25,
                                            "decode_tok_s_b8": 2.0}
    assert result["llamacpp_greedy_match"] is False
    assert result["llamacpp_greedy_prefix_match"] == pytest.approx((1 + 1 / 3) / 2, abs=1e-3)
