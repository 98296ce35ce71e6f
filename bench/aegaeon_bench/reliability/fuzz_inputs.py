"""Bad input for the proxy's two endpoints and the services' ZeroMQ channels (hypothesis
strategies), and what a correct answer to each looks like.

HTTP: random JSON shapes and types in every field the endpoints know (and
unknown ones), huge and negative numbers, integers past 64 bits, invalid
UTF-8, truncated JSON, non-objects, huge ``stop`` lists, ``n > 1``,
``logit_bias``, ``tools``. Every body that could be valid asks for at most a
few tokens (``max_tokens`` is always there, small or absurd), so a live
node spends little on each. A correct answer is never a 5xx: an error is
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (429s
with ``Retry-After``), a success a well-formed body or SSE stream.

ZeroMQ: random bytes, msgpack maps with unknown tags, wrong or missing
versions, valid messages truncated, and frames past the services' size limit.
Needs ``hypothesis`` (the ``dev`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from aegaeon_bench.node.http_client import sse_payloads

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ROLES = ("system", "user", "assistant", "tool", "developer", "robot", "")
ERROR_KEYS = {"message", "type", "param", "code"}

__all__ = ["ENDPOINTS", "HttpCase", "check_http", "http_cases", "zmq_frames"]

scalars = (
    st.none() | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=12,
)  # fmt: skip


def _small_or_absurd_tokens() -> st.SearchStrategy[Any]:
    return (st.integers(min_value=-3, max_value=8)
            | st.sampled_from([0, 10**6, 2**63, 2**64, -(2**63), 1.5, 2.0, "4", None, True])
            | json_values.filter(_not_a_long_generation))  # fmt: skip


def _not_a_long_generation(value: Any) -> bool:
    return not isinstance(value, int) or not 8 < value < 10**6


def _fields(models: Sequence[str]) -> dict[str, st.SearchStrategy[Any]]:
    text = st.text(max_size=200)
    content = text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                     "text": json_values}), max_size=3)
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES)}, optional={
        "content": content | json_values, "name": json_values, "tool_calls": json_values})
    return {
        "model": st.sampled_from(list(models)) | json_values,
        "prompt": text | st.lists(st.integers(-5, 300_000), max_size=20)
        | st.lists(text, max_size=3) | json_values,
        "messages": st.lists(message, max_size=4) | json_values,
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-1, 2) | json_values,
        "top_k": st.integers(-5, 1000) | json_values,
        "seed": st.integers(-(2**70), 2**70) | json_values,
        "stop": text | st.lists(st.text(max_size=400), max_size=40) | json_values,
        "stop_token_ids": st.lists(st.integers(-5, 2**40), max_size=80) | json_values,
        "n": st.integers(-2, 5) | json_values,
        "best_of": st.integers(-2, 5) | json_values,
        "logit_bias": st.dictionaries(st.text(max_size=6), st.integers(-200, 200), max_size=5)
        | json_values,
        "tools": st.lists(st.dictionaries(st.text(max_size=8), json_values, max_size=3),
                          max_size=3) | json_values,
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values})
        | json_values,
        "timeout": st.floats(-5, 1e12) | json_values,
        "ignore_eos": st.booleans() | json_values,
        "presence_penalty": st.floats(-3, 3) | json_values,
        "logprobs": json_values,
        "echo": json_values,
        "response_format": json_values,
        "user": json_values,
        "unknown_field": json_values,
    }  # fmt: skip


def _bodies(models: Sequence[str], endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    """Half: a valid request for ``endpoint`` with up to three fields replaced by
    anything; half: any mix of the fields. ``max_tokens`` is always there."""
    fields = {**_fields(models), "max_completion_tokens": _small_or_absurd_tokens()}
    prompt = ({"messages": st.just([{"role": "user", "content": "Hello"}])}
              if "chat" in endpoint else {"prompt": st.text(min_size=1, max_size=60)})
    valid = st.fixed_dictionaries({
        "model": st.sampled_from(list(models)),
        **prompt,
        "max_tokens": st.integers(1, 8),
        "stream": st.booleans(),
    })  # fmt: skip
    mutations = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names}))
    mutated = st.builds(lambda base, changes: {**base, **changes}, valid, mutations)
    anything = st.fixed_dictionaries({"max_tokens": _small_or_absurd_tokens()},
                                     optional=fields)  # fmt: skip
    return st.one_of(mutated, anything)


@dataclass(frozen=True)
class HttpCase:
    """One request: where, and the raw body."""

    endpoint: str
    body: bytes


def _encode(body: Any) -> bytes:
    # the standard library writes integers past 64 bits (the server must refuse them)
    return json.dumps(body).encode()


def http_cases(models: Sequence[str]) -> st.SearchStrategy[HttpCase]:
    return st.sampled_from(ENDPOINTS).flatmap(lambda endpoint: _http_cases(models, endpoint))


def _http_cases(models: Sequence[str], endpoint: str) -> st.SearchStrategy[HttpCase]:
    objects = _bodies(models, endpoint).map(_encode)
    raw = st.one_of(
        json_values.map(_encode),  # any JSON, mostly not an object
        st.binary(max_size=200),  # anything, invalid UTF-8 included
        objects.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),
        objects.map(lambda b: b.replace(b'"', b"\xff", 1)),  # invalid UTF-8 in valid JSON
        st.just(b'{"model": NaN}') | st.just(b"[" * 5000) | st.just(b'{"a":' * 2000),
    )  # fmt: skip
    body = st.one_of(objects, objects, objects, raw)
    return st.builds(HttpCase, st.just(endpoint), body)


def check_http(case: HttpCase, status: int, headers: dict[str, str], body: bytes) -> list[str]:
    """What is wrong with this answer (empty: nothing)."""
    problems: list[str] = []
    if status >= 500:
        problems.append(f"status {status}")
    if status >= 400:
        try:
            data = json.loads(body)
        except ValueError:
            return [*problems, f"{status} body is not JSON: {body[:80]!r}"]
        error = data.get("error") if isinstance(data, dict) else None
        if not isinstance(error, dict) or set(error) != ERROR_KEYS \
                or not isinstance(error["message"], str) or not isinstance(error["type"], str):
            problems.append(f"{status} body is not OpenAI's error shape: {body[:120]!r}")
        if status == 429 and "Retry-After" not in headers:
            problems.append("429 without Retry-After")
        return problems
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        problems += _check_sse(body)
    else:
        try:
            data = json.loads(body)
        except ValueError:
            return [f"200 body is not JSON: {body[:80]!r}"]
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            problems.append(f"200 body has no choices: {body[:120]!r}")
    return problems


def _check_sse(body: bytes) -> list[str]:
    try:
        payloads = sse_payloads(body)
    except ValueError as exc:
        return [str(exc)]
    for payload in payloads:
        event = json.loads(payload)
        error = event.get("error")
        if error is not None and (not isinstance(error, dict) or set(error) != ERROR_KEYS):
            return [f"stream error event not in OpenAI's shape: {payload[:120]!r}"]
    return []


# ---- ZeroMQ ------------------------------------------------------------------


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=10,
)  # fmt: skip


def zmq_frames(valid: Sequence[bytes], max_frame_bytes: int) -> st.SearchStrategy[bytes]:
    """Frames no channel accepts: random bytes, unknown tags, other versions, valid
    frames (``valid``) truncated, frames over ``max_frame_bytes`` (dropped unread)."""
    enc = msgspec.msgpack.encode
    keys = st.text(max_size=6)
    return st.one_of(
        st.binary(max_size=300),
        st.builds(lambda t, d: enc({"t": t, "v": 1, **d}), st.text(max_size=12),
                  st.dictionaries(keys, msgpack_values, max_size=4)),
        st.builds(_with_version, st.sampled_from(list(valid)),
                  st.one_of(st.none(), st.integers(-3, 99).filter(lambda v: v != 1), st.text())),
        st.sampled_from(list(valid)).flatmap(
            lambda f: st.integers(0, len(f) - 1).map(lambda n: f[:n])),
        st.sampled_from(list(valid)).map(lambda f: f + b"\x00" * 3),  # trailing bytes
        st.just(b"\x00" * (max_frame_bytes + 1)),
    )  # fmt: skip


def _with_version(frame: bytes, version: Any) -> bytes:
    body = msgspec.msgpack.decode(frame)
    if version is None:
        body.pop("v", None)
    else:
        body["v"] = version
    return msgspec.msgpack.encode(body)
