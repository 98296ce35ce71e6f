"""The standalone driver (continuous batching) and the ``aegaeon generate`` command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aegaeon_engine import LLM, SamplingParams
from aegaeon_engine.text import TextCodec
from engine_support import add_tokenizer, make_checkpoint, prompts_of


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("llm") / "m", "qwen3", seed=5,
                           max_position_embeddings=64)
    return add_tokenizer(path)


def test_continuous_batching_equals_one_at_a_time(model_dir: Path) -> None:
    prompts = prompts_of((3, 17, 30, 8, 12), seed=1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (20, 5, 12, 1, 30)]
    alone = LLM(model_dir, dtype="float32")
    expect = [alone.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    # room for ~2 requests at a time: later prompts join as earlier ones finish
    block_bytes = alone.kv_shape.block_bytes
    small = LLM(model_dir, dtype="float32", kv_cache_bytes=5 * block_bytes, max_num_seqs=3)
    assert small.generate(prompts, params) == expect
    assert [len(o) for o in expect] == [20, 5, 12, 1, 30]
    assert len(small.free_blocks) == small.num_blocks


def test_step_wise_api(model_dir: Path) -> None:
    """request/start/step/release, as a server drives them, equal generate."""
    prompts = prompts_of((9, 14), seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32")
    expect = llm.generate(prompts, params)
    block_bytes = llm.kv_shape.block_bytes
    small = LLM(model_dir, dtype="float32", kv_cache_bytes=2 * block_bytes)
    first, second = (small.request(p, params) for p in prompts)
    assert small.start(first) and len(first.output) == 1
    assert not small.start(second) and second.block_ids == [] and second.output == []
    while first.finish_reason is None:
        small.step([first])
    assert first.output == expect[0] and first.finish_reason == "length"
    assert len(small.free_blocks) == small.num_blocks  # a finished request has freed its own
    assert small.start(second)
    small.step([second])
    small.release(second)  # abandoned mid-way
    assert second.output == expect[1][:2] and len(small.free_blocks) == small.num_blocks
    with pytest.raises(ValueError, match="empty prompt"):
        small.request([], params)


def test_window_limits(model_dir: Path) -> None:
    llm = LLM(model_dir, dtype="float32")
    with pytest.raises(ValueError, match="does not fit the window"):
        llm.generate([[5] * 64], SamplingParams(max_tokens=2))
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=10,
                                                  ignore_eos=True))[0]
    assert len(out) == 4 and llm.finish_reasons == ["length"]  # 60 + 4 = the 64-token window
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(RuntimeError, match="KV blocks"):
        LLM(model_dir, kv_cache_bytes=1).generate([[5] * 40], SamplingParams(max_tokens=8))


def test_bf16_serving_runs(model_dir: Path) -> None:
    llm = LLM(model_dir, dtype="bfloat16")
    assert llm.engine.kv_shape.dtype == "bfloat16"
    out = llm.generate(prompts_of((6, 20), seed=2), SamplingParams(max_tokens=5, seed=1))
    assert [len(o) for o in out] == [5, 5]


def test_text_codec_chat_template(model_dir: Path) -> None:
    codec = TextCodec(model_dir)
    assert codec.encode("w5 w6") == [5, 6]
    assert codec.encode_chat([{"role": "user", "content": "w7 w8"}]) == [1, 10, 7, 8, 11, 12]
    assert codec.decode([5, 6]) == "w5 w6"


def test_generate_command(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_cli.main import main

    args = ["generate", "--model", str(model_dir), "--prompt", "w5 w6 w7", "--max-tokens", "6",
            "--ignore-eos", "--ids", "--dtype", "float32"]
    assert main(args) == 0
    text, ids = capsys.readouterr().out.strip().splitlines()
    expect = LLM(model_dir, dtype="float32").generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert eval(ids) == expect
    assert text == " ".join(f"w{i}" for i in expect)
    assert main([*args, "--chat"]) == 0


def test_generate_command_errors(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_cli.main import main

    long_prompt = " ".join(["w5"] * 80)
    assert main(["generate", "--model", str(model_dir), "--prompt", long_prompt]) == 2
    assert "does not fit the window" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir / "nope"), "--prompt", "w1"]) == 2
    assert "config.json: missing file" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompt", "w1",
                 "--temperature", "-1"]) == 2
    assert "SamplingParams.temperature" in capsys.readouterr().err


def test_llm_uses_one_buffer(model_dir: Path) -> None:
    llm = LLM(model_dir, dtype="float32", kv_cache_bytes=1 << 20)
    assert llm.buffer.dtype == torch.uint8
    assert llm.buffer.numel() >= llm.layout.total_bytes + llm.num_blocks * llm.kv_shape.block_bytes
