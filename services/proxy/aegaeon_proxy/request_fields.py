"""Which request fields each endpoint knows: honoured, accepted at their default only,
or harmless and ignored. Anything else is a 400 naming the field.

A client asking for something this server does not do must hear so: a field
left out of these tables (a typo, an extension of another server) is refused by
name instead of silently dropped. Three kinds of known fields:

* **honoured**: the endpoint's own code reads and checks them
  (:mod:`aegaeon_proxy.params`, :mod:`aegaeon_proxy.prompts`, ...);
* **default only**: fields of OpenAI's or vLLM's API this server does not
  implement; their neutral value (the one that asks for nothing) is accepted,
  any other is a 400 saying it is not supported;
* **harmless**: OpenAI fields that change nothing about the generated text and
  are taken and ignored (:data:`HARMLESS`, listed in docs/interfaces.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from aegaeon_proxy.errors import invalid

__all__ = ["HARMLESS", "FieldTable", "check_fields"]

Neutral = Callable[[Any], bool]


def _none(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _true(value: Any) -> bool:
    return value is None or value is True


def _empty(value: Any) -> bool:
    return value is None or value in ("", [], {})


def _equals(default: Any) -> Neutral:
    def neutral(value: Any) -> bool:
        return value is None or (not isinstance(value, bool) and value == default)

    return neutral


# OpenAI fields that do not change what is generated: taken and ignored.
HARMLESS: frozenset[str] = frozenset({
    "user",  # an end-user id for abuse monitoring
    "metadata",  # stored-completion tags (nothing is stored)
    "store",  # store the completion for distillation (nothing is stored)
    "service_tier",  # a billing tier
    "prompt_cache_key",  # a routing hint for OpenAI's prompt cache
    "safety_identifier",  # OpenAI's successor of `user`
    "session_id",  # vLLM: a conversation's id for routing (logged with the request)
    "cache_salt",  # vLLM: salts a prefix cache (this server keeps none across requests)
})  # fmt: skip

# Fields of OpenAI's and vLLM's request bodies this server does not implement:
# accepted only at the value that asks for nothing.
_DEFAULT_ONLY: dict[str, Neutral] = {
    # OpenAI
    "audio": _none, "modalities": lambda v: v is None or v == ["text"], "prediction": _none,
    "web_search_options": _none, "functions": _empty, "function_call": _none,
    "verbosity": _none,
    # vLLM's sampling and output extras
    "use_beam_search": _false, "length_penalty": _equals(1), "watermarking": _false,
    "include_stop_str_in_output": _false, "spaces_between_special_tokens": _true,
    "logprob_token_ids": _empty, "bad_words": _empty, "thinking_token_budget": _none,
    "include_reasoning": _true, "return_weight_versions": _false,
    "routed_experts_prompt_start": _equals(0), "return_token_offsets": _false,
    "return_prompt_text": _false, "mm_payload": lambda v: v is None or v == "tensors",
    "return_mm_kwargs": _none, "media_io_kwargs": _empty, "mm_processor_kwargs": _empty,
    "kv_transfer_params": _empty, "ec_transfer_params": _empty, "vllm_xargs": _empty,
    "repetition_detection": _none, "stream_interval": _equals(1), "prompt_embeds": _none,
    "truncation_side": _none,
    # OpenAI's legacy completions fields
    "best_of": _equals(1), "suffix": _empty,
    # vLLM's: the structured-output backend is this server's (llguidance)
    "guided_decoding_backend": _none, "guided_whitespace_pattern": _none,
    "structural_tag": _none,
}  # fmt: skip


@dataclass(frozen=True)
class FieldTable:
    """One endpoint's fields: those its code honours and those accepted at their
    default only (a field in both is honoured)."""

    honoured: frozenset[str]
    default_only: Mapping[str, Neutral]

    @classmethod
    def of(cls, honoured: Collection[str], default_only: Collection[str] = ()) -> FieldTable:
        """``honoured`` fields; the others of ``default_only`` (names of OpenAI's or
        vLLM's fields this server does not implement) at their neutral value only."""
        refused = {n: _DEFAULT_ONLY.get(n, _empty) for n in default_only if n not in honoured}
        return cls(frozenset(honoured), refused)


def check_fields(body: Mapping[str, Any], table: FieldTable) -> None:
    """A 400 naming the first field of ``body`` that ``table`` does not know, or that
    asks for something not implemented (a default-only field off its default)."""
    for name, value in body.items():
        if name in table.honoured or name in HARMLESS:
            continue
        neutral = table.default_only.get(name)
        if neutral is None:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise invalid(name, f"unknown field '{shown}': this server does not support it",
                          code="unsupported_field")  # fmt: skip
        if not neutral(value):
            raise invalid(name, f"'{name}' is not supported by this server (only its "
                          "default is accepted)", code="unsupported_field")  # fmt: skip


DEFAULT_ONLY_NAMES: frozenset[str] = frozenset(_DEFAULT_ONLY)
