"""Incremental, UTF-8-safe detokenizing.

Byte-level BPE splits a multi-byte character across tokens; decoding a prefix
that ends inside one yields U+FFFD. Such text is held back until the
character completes. Each step decodes a short window (the ids since the last
emission plus the ids of the emission before, as context for decoders that
treat the first token specially) and emits the difference, so a step costs
O(window), not O(all ids) — the way vLLM and TGI do it.

Invariant: the concatenation of everything ``push`` and ``finish`` return
equals ``decode(all ids)``. ``finish`` checks it and emits the remainder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Feed token ids as they come; get back text that is safe to send."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # ids before this are already emitted as text
        self._emitted: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ids; return the newly decodable text ('' while a character is incomplete)."""
        self._ids.extend(token_ids)
        if not token_ids:
            return ""
        window = self._ids[self._prefix_offset :]
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(window)
        if full_text.endswith(REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character at the end, or nothing visible yet
        if not full_text.startswith(prefix_text):
            # the decoder rewrote earlier text (rare: cleanup rules); keep the window
            # and let finish() reconcile against the full decode
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(new_text)
        return new_text

    def finish(self) -> str:
        """The text not yet emitted, so that the total equals ``decode(all ids)``."""
        final = self._decode(self._ids)
        sent = self.text
        if not final.startswith(sent):
            # cannot happen with the decoders of our tokenizers (byte-level BPE,
            # metaspace); emitting nothing keeps what the client has consistent
            return ""
        rest = final[len(sent) :]
        if rest:
            self._emitted.append(rest)
        self._prefix_offset = self._read_offset = len(self._ids)
        return rest
