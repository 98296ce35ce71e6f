"""Sampling and streaming fields shared by both endpoints, checked by a table.

Each field has a checker ``(param, value) -> normalized value`` that raises a
400 :class:`APIError` naming the field; a missing or ``null`` field takes its
default. Which fields an endpoint knows at all is :mod:`aegaeon_proxy.request_fields`'
business (an unknown one is a 400 naming it).

Ollama's ``keep_alive`` (seconds or a duration such as ``"5m"``; 0 unloads the
model after the request, negative keeps it loaded) is taken with Ollama's
meaning (:mod:`aegaeon_proxy.keep_alive`).

Aegaeon's extension fields (SLO classes, :mod:`aegaeon_proxy.slo_classes`):
``priority`` (``"interactive"``, ``"standard"``, ``"batch"``, or vLLM's integer:
below 0 interactive, 0 standard, above 0 batch) and explicit
``ttft_ms`` / ``tbt_ms`` targets (positive numbers of milliseconds), checked
here like every other field; what a caller may ask for is checked later,
against its API key and the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aegaeon_common.config import SLO_CLASS_NAMES
from aegaeon_common.messages.structs import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from aegaeon_sched.priority import BATCH, CLASS_NAMES, INTERACTIVE, STANDARD

from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.keep_alive import parse_keep_alive

Checker = Callable[[str, Any], Any]

SEED_MIN = -(1 << 63)  # OpenAI's seed is an int64
SEED_MAX = (1 << 63) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: a match is checked against every new text piece
MAX_STOP_TOKEN_IDS = 64
MAX_TARGET_MS = 86_400_000.0  # a day: an explicit ttft_ms / tbt_ms beyond it is a typo
MAX_N = 8  # sequences per request (the prompt prefilled once for all)
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_IDS = 1 << 16


# the request fields that fill the one sampling shape (the others fill CommonParams)
SAMPLING_FIELDS: frozenset[str] = frozenset(SamplingParams.__struct_fields__)


@dataclass(frozen=True)
class CommonParams:
    """The fields of a request that are not the prompt, validated: ``sampling`` is the
    wire's :class:`SamplingParams` as the body asked for it (the proxy completes it per
    request, :func:`aegaeon_proxy.prompts.build_request`), the rest is the front's own."""

    model: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # as asked (None: the endpoint's default, the window's)
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    timeout_s: float | None = None  # the request's own deadline (None: the server's)
    # Aegaeon's SLO extension (None: not given): the class asked for and explicit targets
    priority: str | None = None
    ttft_s: float | None = None  # from ttft_ms
    tbt_s: float | None = None  # from tbt_ms
    # Ollama's keep_alive in seconds (None: not given; 0: unload after; inf: keep)
    keep_alive_s: float | None = None
    echo: bool = False  # completions: the prompt first; chat (vLLM's): the last message
    # how tokens read in the answer
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids ("token_id:N")
    return_token_ids: bool = False
    given: frozenset[str] = frozenset()  # the fields the body set (not null)


def check_string(param: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(param, f"'{param}' must be a non-empty string")
    return value


def check_bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"'{param}' must be a boolean")
    return value


def _int(param: str, value: Any, low: int, high: int | None = None) -> int:
    # 2.0 is accepted as 2 (JSON encoders emit floats); 2.5 and true are not
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param, f"'{param}' must be an integer")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise invalid(param, f"'{param}' must be {bound}, got {value}")
    return value


def _number(param: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(param, f"'{param}' must be a number")
    below = value <= low if low_open else value < low
    if below or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise invalid(param, f"'{param}' must be in {interval}, got {value}")
    return float(value)


# the fields that are a bounded integer or number
_max_tokens = partial(_int, low=1)
_min_tokens = partial(_int, low=0)
_n = partial(_int, low=1, high=MAX_N)
_top_count = partial(_int, low=0, high=MAX_LOGPROBS)  # top log-probabilities (OpenAI's bound)
_temperature = partial(_number, low=0.0, high=2.0)
_top_p = partial(_number, low=0.0, high=1.0, low_open=True)
_unit = partial(_number, low=0.0, high=1.0)
_penalty = partial(_number, low=-2.0, high=2.0)
_repetition_penalty = partial(_number, low=0.0, high=100.0, low_open=True)
# seconds until the server ends the request with a `deadline_exceeded` error
_timeout = partial(_number, low=0.0, high=1e9, low_open=True)


def _top_k(param: str, value: Any) -> int:
    return max(_int(param, value, -1), 0)  # 0 and -1 both mean "off"


def _seed(param: str, value: Any) -> int:
    """OpenAI's int64 seed, folded into the sampler's [0, 2**63)."""
    return _int(param, value, SEED_MIN, SEED_MAX) % SEED_RANGE


def _stop(param: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid(param, f"'{param}' must be a non-empty string or a list of them")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(param, f"'{param}' may hold at most {MAX_STOP_STRINGS} strings")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise invalid(param, f"a '{param}' string may have at most {MAX_STOP_CHARS} characters")
    return tuple(items)


def _ids(param: str, value: Any, most: int, empty: bool) -> tuple[int, ...]:
    """A list of at most ``most`` token ids (``empty``: it may hold none)."""
    if not isinstance(value, list) or not (value or empty):
        kind = "list" if empty else "non-empty list"
        raise invalid(param, f"'{param}' must be a {kind} of token ids")
    if len(value) > most:
        raise invalid(param, f"'{param}' may hold at most {most} token ids")
    return tuple(_int(param, v, 0) for v in value)


_token_ids = partial(_ids, most=MAX_STOP_TOKEN_IDS, empty=True)
_allowed_ids = partial(_ids, most=MAX_ALLOWED_IDS, empty=False)


def _priority(param: str, value: Any) -> str:
    """An SLO class by name, or vLLM's integer priority (lower is more urgent):
    below 0 ``interactive``, 0 (vLLM's default) ``standard``, above 0 ``batch``."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if integral and not isinstance(value, bool) and SEED_MIN <= value <= SEED_MAX:
        rank = int(value)
        return CLASS_NAMES[INTERACTIVE if rank < 0 else STANDARD if rank == 0 else BATCH]
    if not isinstance(value, str) or value not in SLO_CLASS_NAMES:
        names = ", ".join(repr(n) for n in SLO_CLASS_NAMES)
        shown = repr(value)[:60]  # a client's value, cut short
        raise invalid(param, f"'{param}' must be one of {names} or an integer (vLLM's "
                      f"priority: lower is more urgent), got {shown}")  # fmt: skip
    return value


def _millis(param: str, value: Any) -> float:
    """A target in milliseconds (> 0), as seconds."""
    return _number(param, value, 0.0, MAX_TARGET_MS, low_open=True) / 1000.0


def _logit_bias(param: str, value: Any) -> dict[int, float]:
    """OpenAI's: token ids (as JSON object keys) to a bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise invalid(param, f"'{param}' must be an object of token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(param, f"'{param}' may hold at most {MAX_LOGIT_BIAS} tokens")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 12):
            raise invalid(param, f"'{param}' keys must be token ids, got {key[:20]!r}")
        out[int(key)] = _number(f"{param}.{key}", bias, -100.0, 100.0)
    return out


def _completion_logprobs(param: str, value: Any) -> int:
    """Completions' ``logprobs``: how many top tokens (0..20) per token; ``false`` off."""
    if value is False:
        return -1
    return _top_count(param, value)


def _chat_logprobs(param: str, value: Any) -> int:
    """Chat's ``logprobs``: the chosen tokens' (0; ``top_logprobs`` adds more), or off."""
    return 0 if check_bool(param, value) else -1


def _stream_options(param: str, value: Any) -> bool:
    if not isinstance(value, dict):
        raise invalid(param, f"'{param}' must be an object")
    include = value.get("include_usage", False)
    if include is None:
        return False
    return check_bool(f"{param}.include_usage", include)


# request field -> (SamplingParams or CommonParams field, checker)
FIELDS: dict[str, tuple[str, Checker]] = {
    "stream": ("stream", check_bool),
    "stream_options": ("include_usage", _stream_options),
    "max_tokens": ("max_tokens", _max_tokens),
    "temperature": ("temperature", _temperature),
    "top_p": ("top_p", _top_p),
    "top_k": ("top_k", _top_k),
    "seed": ("seed", _seed),
    "stop": ("stop", _stop),
    "stop_token_ids": ("stop_token_ids", _token_ids),
    "ignore_eos": ("ignore_eos", check_bool),
    "timeout": ("timeout_s", _timeout),
    "priority": ("priority", _priority),
    "ttft_ms": ("ttft_s", _millis),
    "tbt_ms": ("tbt_s", _millis),
    "keep_alive": ("keep_alive_s", parse_keep_alive),
    "n": ("n", _n),
    "min_p": ("min_p", _unit),
    "presence_penalty": ("presence_penalty", _penalty),
    "frequency_penalty": ("frequency_penalty", _penalty),
    "repetition_penalty": ("repetition_penalty", _repetition_penalty),
    "logit_bias": ("logit_bias", _logit_bias),
    "allowed_token_ids": ("allowed_token_ids", _allowed_ids),
    "min_tokens": ("min_tokens", _min_tokens),
    "prompt_logprobs": ("prompt_logprobs", _top_count),
    "skip_special_tokens": ("skip_special_tokens", check_bool),
    "return_tokens_as_token_ids": ("tokens_as_ids", check_bool),
    "return_token_ids": ("return_token_ids", check_bool),
}
COMPLETION_FIELDS: dict[str, tuple[str, Checker]] = {
    **FIELDS,
    "logprobs": ("logprobs", _completion_logprobs),
    "echo": ("echo", check_bool),
}
CHAT_FIELDS: dict[str, tuple[str, Checker]] = {
    **FIELDS,
    "max_completion_tokens": ("max_tokens", _max_tokens),  # wins over max_tokens (after it)
    "logprobs": ("logprobs", _chat_logprobs),
    "top_logprobs": ("top_logprobs", _top_count),  # how many, with `logprobs: true`
    "echo": ("echo", check_bool),  # vLLM's: the last message first, when it is the assistant's
}


# generation_config.json keys a model may default (vLLM's `--generation-config auto`)
MODEL_DEFAULTS: dict[str, Checker] = {
    "temperature": _temperature, "top_p": _top_p, "top_k": _top_k,
}  # fmt: skip


def model_defaults(generation: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a model's ``generation_config.json`` sets, checked like a
    request's fields (ValueError naming the key on a bad value)."""
    found: dict[str, Any] = {}
    for key, check in MODEL_DEFAULTS.items():
        if generation.get(key) is not None:
            try:
                found[key] = check(key, generation[key])
            except APIError as exc:
                raise ValueError(f"{key}: {exc.message}") from None
    return found


def parse_common(
    body: Mapping[str, Any], fields: Mapping[str, tuple[str, Checker]]
) -> CommonParams:
    """Validate the shared fields of a request body (a JSON object): the sampling ones
    into the wire's :class:`SamplingParams`, the others beside it."""
    model = check_string("model", body.get("model"))
    values: dict[str, Any] = {}
    for name, (target, check) in fields.items():
        value = body.get(name)
        if value is not None:
            values[target] = check(name, value)
    top = values.pop("top_logprobs", None)  # chat's count, with `logprobs: true`
    if top:
        if values.get("logprobs", -1) < 0:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        values["logprobs"] = top
    asked = {k: values.pop(k) for k in SAMPLING_FIELDS & values.keys()}
    max_tokens = asked.pop("max_tokens", None)  # resolved against the window per request
    given = frozenset(k for k, v in body.items() if v is not None)
    return CommonParams(model=model, sampling=SamplingParams(**asked), max_tokens=max_tokens,
                        given=given, **values)  # fmt: skip
