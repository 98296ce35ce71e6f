"""Through `aegaeon serve` (the shared node): the API surface clients of vLLM call beyond
plain generation — request ids, the access log, /tokenize, /detokenize, /version,
vLLM's integer priority, unknown fields refused by name."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from serve_harness import Served, call_json, until
from tokenizers import Tokenizer


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0, timeout=120)


def _model(served: Served, k: int = 0) -> str:
    return [m.id for m in _client(served).models.list().data][k]


def test_tokenize_ids_equal_the_models_tokenizer(served: Served, small_market: Path) -> None:
    model = _model(served)
    tokenizer = Tokenizer.from_file(str(small_market / model / "tokenizer.json"))
    text = "Tokenize me, please: 42 🚀"
    status, out = call_json(served.url, "POST", "/tokenize", {"model": model, "prompt": text})
    assert status == 200
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=True).ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    status, back = call_json(served.url, "POST", "/detokenize",
                             {"model": model, "tokens": out["tokens"]})
    assert status == 200
    assert back["prompt"] == tokenizer.decode(out["tokens"], skip_special_tokens=False)
    # chat messages: the ids the chat endpoint prefills (usage counts them)
    messages = [{"role": "user", "content": text}]
    status, chat = call_json(served.url, "POST", "/tokenize",
                             {"model": model, "messages": messages})
    assert status == 200
    reply = _client(served).chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == chat["count"]
    status, version = call_json(served.url, "GET", "/version")
    assert status == 200 and isinstance(version["version"], str)


def test_request_id_travels_to_the_stats_and_the_access_log(served: Served) -> None:
    model = _model(served)
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 3,
                       "ignore_eos": True, "priority": 0}).encode()  # vLLM's integer priority
    req = urllib.request.Request(served.base_url + "/completions", data=body, headers={
        "Content-Type": "application/json", "X-Request-Id": "e2e-trace-7"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["X-Request-Id"] == "e2e-trace-7"
        out = json.loads(resp.read())
    assert out["id"] == "cmpl-e2e-trace-7"

    def recorded() -> bool:
        stats = served.get_json("/v1/aegaeon/stats")
        timings = stats["timings"]
        assert isinstance(timings, list)
        return any(t["request_id"] == "e2e-trace-7" for t in timings)

    until("the request's timing record", recorded, 10)

    def logged() -> dict[str, Any] | None:
        for line in (served.run_dir / "proxy.log").read_text(errors="replace").splitlines():
            if '"request_done"' in line and "e2e-trace-7" in line:
                return dict(json.loads(line[line.index("{"):]))
        return None

    line = until("the access log line", logged, 10)
    assert line["level"] == "info" and line["status"] == 200 and line["model"] == model
    assert line["prompt_tokens"] > 0 and line["output_tokens"] == 3
    assert line["ttft_s"] > 0 and line["total_s"] >= line["ttft_s"]


@pytest.mark.parametrize(("field", "value"), [("guided_jsn", {"type": "object"}),
                                              ("use_beam_search", True)])
def test_an_unknown_or_unsupported_field_is_a_400_naming_it(served: Served, field: str,
                                                            value: Any) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        _client(served).completions.create(model=_model(served), prompt="x", max_tokens=1,
                                           extra_body={field: value})
    assert info.value.body is not None
    assert info.value.body["param"] == field  # type: ignore[index]
