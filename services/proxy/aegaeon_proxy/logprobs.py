"""Log-probabilities in OpenAI's and vLLM's shapes.

The instances report each token's log-probability (from the model's logits as
they came, before temperature or any other processing, as OpenAI and vLLM
report them), its rank and the top tokens' (:class:`TokenLogprobs`). Here they
become:

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
  (with ``echo``, the prompt's tokens first: the first one has no log-probability,
  ``null``, as OpenAI answers);
* vLLM's ``prompt_logprobs``: ``[null, {"<id>": {"logprob", "rank",
  "decoded_token"}}, ...]``, the prompt token's own entry first.

A token reads as its text alone (special tokens included), or as ``token_id:N``
with vLLM's ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aegaeon_common.messages.structs import TokenLogprobs
from tokenizers import Tokenizer

from aegaeon_proxy.assets import ModelAssets

JSON = dict[str, Any]

__all__ = ["LogprobFormat"]


class LogprobFormat:
    """Turns token ids and their :class:`TokenLogprobs` into one answer's shapes: chat's
    (``chat``) or completions' (each choice's text offsets carried from delta to
    delta)."""

    def __init__(self, assets: ModelAssets, tokens_as_ids: bool = False, *, chat: bool = False,
                 n: int = 1) -> None:  # fmt: skip
        self._tokenizer = assets.tokenizer
        self._as_ids = tokens_as_ids
        self._chat = chat
        self._cache: dict[int, str] = {}
        self._offsets = [0] * n  # completions: each choice's text_offset of its next token

    def delta(self, index: int, token_ids: Sequence[int],
              logprobs: Sequence[TokenLogprobs]) -> JSON | None:  # fmt: skip
        """Choice ``index``'s next tokens (a delta's) in the endpoint's shape; None when
        none came with log-probabilities."""
        if not logprobs:
            return None
        ids = list(token_ids[: len(logprobs)])
        if self._chat:
            return {"content": self.chat(ids, logprobs)}
        obj = self.completion(ids, logprobs, self._offsets[index])
        if ids:
            self._offsets[index] = obj["text_offset"][-1] + len(obj["tokens"][-1])
        return obj

    def whole(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
              echoed: JSON | None = None) -> JSON:  # fmt: skip
        """A whole choice's tokens in the endpoint's shape, after the ``echoed`` prompt's
        (:meth:`echo`) when given."""
        ids = token_ids[: len(logprobs)]
        if self._chat:
            return {"content": self.chat(ids, logprobs)}
        obj = self.completion(ids, logprobs)
        return obj if echoed is None else _joined(echoed, obj)

    def echo(self, prompt_ids: Sequence[int],
             scored: Sequence[TokenLogprobs] | None) -> JSON | None:  # fmt: skip
        """Completions' echoed prompt: its tokens, the first without a log-probability
        (``scored``: the others'); None for chat (its echo, the last message, has none)."""
        if self._chat:
            return None
        lps = [None, *(scored or ())][: len(prompt_ids)]
        lps += [None] * (len(prompt_ids) - len(lps))
        return self.completion(prompt_ids, lps)

    def token(self, token_id: int) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            tokenizer: Tokenizer = self._tokenizer  # the library's decode, special tokens kept
            text = self._cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _entry(self, token_id: int, logprob: float) -> JSON:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[JSON]:
        """Chat's ``logprobs.content`` entries of these tokens."""
        return [
            {**self._entry(t, lp.logprob),
             "top_logprobs": [self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs,
                                                               strict=True)]}
            for t, lp in zip(token_ids, logprobs, strict=True)
        ]  # fmt: skip

    def completion(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None],
                   offset: int = 0) -> JSON:
        """Completions' ``logprobs`` object of these tokens; ``offset``: the text offset
        of the first (None log-probabilities: the prompt's first token)."""
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob if lp is not None else None for lp in logprobs],
            "top_logprobs": [self._top(t, lp) for t, lp in zip(token_ids, logprobs,
                                                               strict=True)],
            "text_offset": offsets,
        }  # fmt: skip

    def _top(self, token_id: int, lp: TokenLogprobs | None) -> dict[str, float] | None:
        if lp is None:
            return None
        top = {self.token(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        top.setdefault(self.token(token_id), lp.logprob)  # the chosen token, as vLLM does
        return top

    def prompt(self, prompt_ids: Sequence[int],
               logprobs: Sequence[TokenLogprobs]) -> list[JSON | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (the first: null) its own entry
        and the top tokens'."""
        out: list[JSON | None] = [None]
        for token_id, lp in zip(prompt_ids[1:], logprobs, strict=False):
            entry = {str(token_id): self._vllm(token_id, lp.logprob, lp.rank)}
            for rank, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
                entry.setdefault(str(i), self._vllm(i, v, rank))
            out.append(entry)
        return out

    def _vllm(self, token_id: int, logprob: float, rank: int) -> JSON:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token(token_id)}


def _joined(first: JSON, second: JSON) -> JSON:
    """Two completions ``logprobs`` objects as one (the second's offsets after the first's
    text)."""
    end = (first["text_offset"][-1] + len(first["tokens"][-1])) if first["tokens"] else 0
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [end + o for o in second["text_offset"]],
    }
