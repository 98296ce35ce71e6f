"""LoRA adapters of the real SmolLM2-135M-Instruct through `aegaeon serve`, against PEFT.

Three adapters made by ``peft`` on the float32 model (random A and B; ranks 8,
16 with rsLoRA and 64; different target modules) are added to a market beside
it (``market add --adapter``). Each adapter's served greedy continuation equals
transformers + PEFT (``merge_and_unload``) on the same weights, token for token,
on 4 prompts, alone and with the base and the other adapters decoding at the
same time (no weight switch: one base serves them all). At run time,
``/v1/load_lora_adapter`` serves a fourth adapter from its own folder (its
output equals PEFT's too) and ``/v1/unload_lora_adapter`` removes it; bad
adapters (wrong shapes, an unknown base, a missing file) are 400s naming what
is wrong, and the market is left as it was.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from http_support import call_json, post_text
from lora_support import (
    ADAPTERS,
    lora_market,
    make_peft_adapter,
    peft_prompt_logprobs,
    peft_references,
)
from real_market import REAL, real_market_dir, stream_greedy, streamed_pieces
from serve_harness import Served, serving, until

# the references (transformers + PEFT) and a node of the real model: minutes on a busy CPU
pytestmark = pytest.mark.timeout(1800)
NUM_TOKENS = 12
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ",
           "Water boils at a temperature of", "import numpy as np\n"]
NAMES = [f"lora-r{rank}" for rank, _, _ in ADAPTERS]


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return real_market_dir() / REAL


@pytest.fixture(scope="module")
def prompt_ids(base_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    return [list(tokenizer(p).input_ids) for p in PROMPTS]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-serve")


@pytest.fixture(scope="module")
def market(base_dir: Path, work: Path) -> Path:
    """The real model linked into a market of its own, with the three adapters added."""
    from aegaeon_market.adapters import add_adapter

    root = lora_market(work / "market", {REAL: base_dir})
    for k, (rank, targets, rslora) in enumerate(ADAPTERS):
        made = make_peft_adapter(base_dir, work / "peft" / NAMES[k], rank, targets, rslora,
                                 seed=100 + k, keep=True)
        add_adapter(root, made.path, NAMES[k], REAL)
    return root


@pytest.fixture(scope="module")
def extra_adapter(base_dir: Path, work: Path) -> Path:
    """A fourth adapter, left in its own folder (loaded at run time)."""
    return make_peft_adapter(base_dir, work / "peft" / "extra", 16, ("q_proj", "o_proj",
                                                                    "down_proj"),
                             seed=200, keep=True).path


@pytest.fixture(scope="module")
def references(base_dir: Path, work: Path, extra_adapter: Path,
               prompt_ids: list[list[int]]) -> dict[str | None, list[list[int]]]:  # fmt: skip
    dirs: dict[str, Path | None] = {"": None, "extra": extra_adapter}
    dirs |= {name: work / "peft" / name for name in NAMES}
    refs = peft_references(base_dir, dirs, prompt_ids, NUM_TOKENS, keep=True)
    return {(name or None): tokens for name, tokens in refs.items()}


@pytest.fixture(scope="module")
def served(market: Path, work: Path) -> Iterator[Served]:
    with serving(market, work / "run") as node:
        yield node


def test_models_list_adapters_with_parent_and_root(served: Served, market: Path) -> None:
    status, body = call_json(served.url, "GET", "/v1/models")
    assert status == 200
    rows = {m["id"]: m for m in body["data"]}
    assert rows[REAL]["parent"] is None and rows[REAL]["root"] == REAL
    for name in NAMES:
        assert rows[name]["parent"] == REAL
        assert Path(rows[name]["root"]) == market / name


def test_each_adapter_alone_equals_peft(served: Served, base_dir: Path,
                                       prompt_ids: list[list[int]],
                                       references: dict[str | None, list[list[int]]]) -> None:
    client = served.client(300)
    for name in (None, *NAMES):
        for ids, want in zip(prompt_ids, references[name], strict=True):
            pieces, used = stream_greedy(client, name or REAL, ids, NUM_TOKENS)
            assert used == NUM_TOKENS
            assert pieces == streamed_pieces(base_dir, want), (name, ids)
    assert len({str(r) for r in references.values()}) == len(references)  # all differ


def test_base_and_adapters_at_once_are_unchanged_with_no_switch(
        served: Served, base_dir: Path, prompt_ids: list[list[int]],
        references: dict[str | None, list[list[int]]]) -> None:
    client = served.client(300)
    # the base on the device before counting
    stream_greedy(client, REAL, prompt_ids[0], NUM_TOKENS)
    jobs = [(name, k) for k in range(len(PROMPTS)) for name in (None, *NAMES)]
    got: dict[tuple[str | None, int], tuple[list[str], int]] = {}
    before = served.switches()

    def run(job: tuple[str | None, int]) -> None:
        got[job] = stream_greedy(client, job[0] or REAL, prompt_ids[job[1]], NUM_TOKENS)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert served.switches() == before  # adapters of the resident base: no weight switch
    for (name, k), (pieces, used) in sorted(got.items(), key=str):
        assert used == NUM_TOKENS
        assert pieces == streamed_pieces(base_dir, references[name][k]), (name, k)
    assert len(got) == len(jobs)


def test_an_adapter_as_the_model_takes_the_api_fields(
        served: Served, base_dir: Path, work: Path, prompt_ids: list[list[int]],
        references: dict[str | None, list[list[int]]]) -> None:
    """The request surface with an adapter as the model: echo with prompt and token
    log-probabilities (the prompt's against transformers + PEFT merged in float32,
    bounded by how far that reference itself moves in bfloat16), ``n`` choices from one
    prefill (greedy: each the PEFT output), chat log-probabilities and a structured
    output."""
    name, k = NAMES[1], 2
    ids, want = prompt_ids[k], references[NAMES[1]][k]
    client = served.client(300)
    out = client.completions.create(model=name, prompt=ids, max_tokens=NUM_TOKENS,
                                    temperature=0, logprobs=2, echo=True, n=2,
                                    extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.text.endswith("".join(streamed_pieces(base_dir, want))), choice.text
        assert choice.logprobs is not None
        assert len(choice.logprobs.token_logprobs or []) == len(ids) + NUM_TOKENS
        assert all(len(t) >= 1 for t in (choice.logprobs.top_logprobs or [])[1:])
    first = out.choices[0].logprobs
    assert first is not None and first.token_logprobs is not None
    lps = first.token_logprobs[1:len(ids)]
    f32, bf16 = (peft_prompt_logprobs(base_dir, work / "peft" / name, ids, dtype)
                 for dtype in (torch.float32, torch.bfloat16))
    assert (torch.tensor(lps, dtype=torch.float32) - f32).abs().max() <= (bf16 - f32).abs().max()
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Name a color."}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    picked = client.completions.create(model=name, prompt="My favourite color is",
                                       max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert picked.choices[0].text in ("red", "green", "blue")


def _market_bytes(market: Path) -> bytes:
    return (market / "market.json").read_bytes()


def test_load_then_request_then_unload(served: Served, base_dir: Path, market: Path,
                                       extra_adapter: Path, prompt_ids: list[list[int]],
                                       references: dict[str | None, list[list[int]]]) -> None:
    before = _market_bytes(market)
    status, _ = post_text(served.url, "/v1/load_lora_adapter",
                      {"lora_name": "extra", "lora_path": str(extra_adapter)})
    assert status == 200
    status, models = call_json(served.url, "GET", "/v1/models")
    assert {"id": "extra", "parent": REAL}.items() <= next(
        m for m in models["data"] if m["id"] == "extra").items()
    pieces, _ = stream_greedy(served.client(300), "extra", prompt_ids[1], NUM_TOKENS)
    assert pieces == streamed_pieces(base_dir, references["extra"][1])
    status, body = post_text(served.url, "/v1/load_lora_adapter",
                         {"lora_name": "extra", "lora_path": str(extra_adapter)})
    assert status == 400 and "already been loaded" in body
    status, _ = post_text(served.url, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert status == 200
    status, body = call_json(served.url, "POST", "/v1/completions",
                             {"model": "extra", "prompt": "hi", "max_tokens": 2})
    assert status == 404, body
    assert _market_bytes(market) == before  # run-time adapters never touch the market


def test_bad_adapters_are_400s_naming_them(served: Served, market: Path, work: Path,
                                           extra_adapter: Path, small_market: Path) -> None:
    before = _market_bytes(market)
    # an adapter of another model (the e2e market's smallest): its shapes do not fit
    other_base = small_market / "llama-gqa-5m"
    wrong = make_peft_adapter(other_base, work / "wrong-shapes", 8, ("q_proj", "v_proj"),
                              keep=True).path
    missing = work / "missing-file"
    shutil.copytree(extra_adapter, missing)
    (missing / "adapter_model.safetensors").unlink()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"lora_name": "bad", "lora_path": str(wrong), "base": REAL}, "wrong shape"),
        ({"lora_name": "bad", "lora_path": str(extra_adapter), "base": "no-such-base"},
         "no-such-base"),
        ({"lora_name": "bad", "lora_path": str(missing)}, "adapter_model.safetensors"),
        ({"lora_name": "bad", "lora_path": str(work / "nowhere")}, str(work / "nowhere")),
    ]
    for body, named in cases:
        status, text = post_text(served.url, "/v1/load_lora_adapter", body)
        assert status == 400, (body, text)
        assert named in text, (body, text)
    status, models = call_json(served.url, "GET", "/v1/models")
    assert "bad" not in {m["id"] for m in models["data"]}
    assert _market_bytes(market) == before
    until("the node still serves", lambda: call_json(served.url, "GET", "/ready")[0] == 200, 30)

