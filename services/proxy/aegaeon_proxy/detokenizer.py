"""Incremental, UTF-8-safe detokenizing on ``tokenizers.decoders.DecodeStream``.

Byte-level BPE and byte-fallback split a multi-byte character across tokens;
decoding a prefix that ends inside one yields U+FFFD. ``DecodeStream`` holds
such text back until the character completes, and each step decodes only a
short window (the way vLLM and TGI do it), so a step costs O(window), not
O(all ids). Its per-token deltas are the ones the hand-written window decoder
this replaced produced, for the market's tokenizers (Llama-3, Mistral byte
fallback, Qwen2, SmolLM2), special tokens skipped.

Invariant: the concatenation of everything ``push`` and ``finish`` return
equals ``decode(all ids)``. The stream never emits bytes that do not complete
a character (arbitrary ids can end on one): ``finish`` emits that remainder.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Feed token ids as they come; get back text that is safe to send."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ids; return the newly decodable text ('' while a character is incomplete)."""
        self._ids.extend(token_ids)
        if self._stream is None:
            return ""
        pieces: list[str] = []
        for token_id in token_ids:
            try:
                piece = self._stream.step(self._tokenizer, token_id)
            except Exception:  # the Rust side raises a bare Exception
                # the decoder rewrote earlier text (rare: cleanup rules): hold the
                # rest and let finish() reconcile against the full decode
                self._stream = None
                break
            if piece:
                pieces.append(piece)
        new_text = "".join(pieces)
        if new_text:
            self._emitted.append(new_text)
        return new_text

    def finish(self) -> str:
        """The text not yet emitted, so that the total equals ``decode(all ids)``."""
        final = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        sent = self.text
        if not final.startswith(sent):
            # cannot happen with the decoders of our tokenizers (byte-level BPE,
            # metaspace); emitting nothing keeps what the client has consistent
            return ""
        rest = final[len(sent) :]
        if rest:
            self._emitted.append(rest)
        self._stream = DecodeStream(skip_special_tokens=self._skip)  # later ids start afresh
        return rest
