"""Every field of vLLM's ``ChatCompletionRequest`` is honoured or refused by name.

The list is vLLM's own (``vllm/entrypoints/openai/chat_completion/protocol.py`` of
vLLM 0.34, in its order), plus the ``guided_*`` fields older vLLM releases took at
the top level. Each is sent with a value that asks for something (not its default):
an honoured field is answered 200, any other with a 400 whose ``param`` names it.
Nothing is dropped silently.
"""

from __future__ import annotations

import json
from typing import Any

from proxy_support import MODEL, Client, ScriptedBackend

HONOURED = "honoured"
REFUSED = "refused"

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]

# name -> (a value that asks for something, what the server does, more body it needs)
VLLM_CHAT_FIELDS: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "messages": ([{"role": "user", "content": "Hi"}], HONOURED, {}),
    "model": (MODEL, HONOURED, {}),
    "frequency_penalty": (0.5, HONOURED, {}),
    "logit_bias": ({"5": 10}, HONOURED, {}),
    "logprobs": (True, HONOURED, {}),
    "top_logprobs": (2, HONOURED, {"logprobs": True}),
    "max_tokens": (3, HONOURED, {}),
    "max_completion_tokens": (3, HONOURED, {}),
    "n": (2, HONOURED, {}),
    "presence_penalty": (0.5, HONOURED, {}),
    "response_format": ({"type": "json_object"}, HONOURED, {}),
    "seed": (7, HONOURED, {}),
    "stop": (["\n"], HONOURED, {}),
    "stream": (True, HONOURED, {}),
    "stream_options": ({"include_usage": True}, HONOURED, {"stream": True}),
    "temperature": (0.5, HONOURED, {}),
    "top_p": (0.5, HONOURED, {}),
    "tools": (TOOLS, HONOURED, {}),
    "tool_choice": ("required", HONOURED, {"tools": TOOLS}),
    "reasoning_effort": ("low", HONOURED, {}),
    "thinking_token_budget": (64, REFUSED, {}),
    "include_reasoning": (False, REFUSED, {}),
    "parallel_tool_calls": (False, HONOURED, {}),
    "user": ("someone", HONOURED, {}),
    "use_beam_search": (True, REFUSED, {}),
    "top_k": (5, HONOURED, {}),
    "min_p": (0.1, HONOURED, {}),
    "repetition_penalty": (1.2, HONOURED, {}),
    "watermarking": (True, REFUSED, {}),
    "length_penalty": (2.0, REFUSED, {}),
    "stop_token_ids": ([5], HONOURED, {}),
    "include_stop_str_in_output": (True, REFUSED, {}),
    "ignore_eos": (True, HONOURED, {}),
    "min_tokens": (2, HONOURED, {}),
    "skip_special_tokens": (False, HONOURED, {}),
    "spaces_between_special_tokens": (False, REFUSED, {}),
    "truncate_prompt_tokens": (4, HONOURED, {}),
    "truncation_side": ("right", REFUSED, {}),
    "prompt_logprobs": (1, HONOURED, {}),
    "logprob_token_ids": ([5], REFUSED, {"logprobs": True}),
    "allowed_token_ids": ([5, 6], HONOURED, {}),
    "bad_words": (["no"], REFUSED, {}),
    "echo": (True, HONOURED, {}),
    "add_generation_prompt": (False, HONOURED, {}),
    "continue_final_message": (True, HONOURED, {
        "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello"}]}),
    "add_special_tokens": (True, HONOURED, {}),
    "documents": ([{"title": "t", "text": "x"}], HONOURED, {}),
    "chat_template": ("{% for m in messages %}{{ m.content }}{% endfor %}", HONOURED, {}),
    "chat_template_kwargs": ({"enable_thinking": False}, HONOURED, {}),
    "media_io_kwargs": ({"image": {"x": 1}}, REFUSED, {}),
    "mm_processor_kwargs": ({"x": 1}, REFUSED, {}),
    "structured_outputs": ({"choice": ["a", "b"]}, HONOURED, {}),
    "priority": (-1, HONOURED, {}),
    "request_id": ("vllm-field-id", HONOURED, {}),
    "session_id": ("conversation-1", HONOURED, {}),
    "return_tokens_as_token_ids": (True, HONOURED, {"logprobs": True}),
    "return_token_ids": (True, HONOURED, {}),
    "return_weight_versions": (True, REFUSED, {}),
    "routed_experts_prompt_start": (2, REFUSED, {}),
    "return_token_offsets": (True, REFUSED, {}),
    "return_prompt_text": (True, REFUSED, {}),
    "mm_payload": ("none", REFUSED, {}),
    "return_mm_kwargs": (False, REFUSED, {}),
    "cache_salt": ("salt-of-the-earth", HONOURED, {}),
    "kv_transfer_params": ({"do_remote_decode": True}, REFUSED, {}),
    "ec_transfer_params": ({"x": 1}, REFUSED, {}),
    "vllm_xargs": ({"x": 1}, REFUSED, {}),
    "repetition_detection": ({"max_pattern_size": 4}, REFUSED, {}),
    "stream_interval": (4, REFUSED, {}),
    # older vLLM's top-level structured-output fields
    "guided_json": ({"type": "object"}, HONOURED, {}),
    "guided_choice": (["a", "b"], HONOURED, {}),
    "guided_regex": ("[a-z]+", HONOURED, {}),
    "guided_grammar": ('start: "a"', HONOURED, {}),
}  # fmt: skip


async def test_every_vllm_chat_field_is_honoured_or_refused_by_name(
    client: Client, backend: ScriptedBackend, tok: Any
) -> None:
    wrong: list[str] = []
    backend.token_ids = tok.encode(" fine", add_special_tokens=False)
    for name, (value, status, more) in VLLM_CHAT_FIELDS.items():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4, **more, name: value}  # fmt: skip
        resp = await client.post("/v1/chat/completions", json=body)
        answer = await resp.read()
        param = json.loads(answer)["error"]["param"] if resp.status != 200 else None
        want = (200, None) if status == HONOURED else (400, name)
        right = (resp.status, param if status == REFUSED else None) == want
        if not right:
            wrong.append(f"{name}: {resp.status} {answer[:200]!r}")
    assert not wrong, "\n".join(wrong)
