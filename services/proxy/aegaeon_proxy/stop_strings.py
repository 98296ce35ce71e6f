"""Stop strings over streamed text.

Text that could be the start of a stop string is held back, not sent early:
the held text is always the longest suffix of the text so far that is a
proper prefix of some stop string. Any stop string that starts earlier would
already be complete, so searching ``held + new`` finds the first match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StopResult", "StopStringMatcher"]


@dataclass(frozen=True)
class StopResult:
    text: str  # safe to send now
    stopped: bool  # a stop string matched; ``text`` ends just before it


class StopStringMatcher:
    """Feed text deltas; get back what may be sent, and whether to stop."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, delta: str) -> StopResult:
        """Add newly decoded text."""
        if self._stopped:
            return StopResult("", True)
        if not self._stop:
            return StopResult(delta, False)
        text = self._held + delta
        cut = min((i for s in self._stop if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return StopResult(text[:cut], True)
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """At the end of generation: the held text is not a stop string, send it."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
