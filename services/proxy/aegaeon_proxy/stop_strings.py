"""Stop strings over streamed text.

Text that could be the start of a stop string is held back, not sent early:
the held text is always the longest suffix of the text so far that is a
proper prefix of some stop string. Any stop string that starts earlier would
already be complete, so searching ``held + new`` finds the first match.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStringMatcher", "partial_suffix"]


class StopStringMatcher:
    """Feed text deltas; get back what may be sent, and whether to stop."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, delta: str) -> str:
        """Add newly decoded text; returns the text safe to send now (once :attr:`stopped`,
        it ends just before the stop string)."""
        if self._stopped:
            return ""
        if not self._stop:
            return delta
        text = self._held + delta
        cut = min((i for s in self._stop if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return text[:cut]
        # the longest suffix of the text that is a proper prefix of a stop string
        keep = max(partial_suffix(text, stop) for stop in self._stop)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: the held text is not a stop string, send it."""
        held, self._held = self._held, ""
        return "" if self._stopped else held


def partial_suffix(text: str, word: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``word``."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
