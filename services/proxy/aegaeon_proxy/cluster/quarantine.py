"""Models whose checkpoint cannot be read, as a proxy backend learns them (quarantine).

A cachemgr refuses to load a model whose files are missing, truncated, corrupt or not
as ``market.json`` records them, and says so in its stats (``unavailable``); an
instance that meets one fails the work for it with ``model_unavailable``; an admin
operation (an add, a pin) gets ``checkpoint_error`` back. Each of these reaches the
backend's :class:`Quarantine`, which tells the front (the model table answers 503
``model_unavailable`` from then on) until a reload lifts it. Every proxy polls the
cachemgrs (every :data:`WATCH_S`) and shares the set through the store
(``cluster.models``), so that every proxy refuses the model as soon as one learnt it.
"""

from __future__ import annotations

from collections.abc import Callable

from aegaeon_common.logs import get_logger

__all__ = ["POLL_TIMEOUT_S", "WATCH_S", "Quarantine"]

log = get_logger("cluster")

WATCH_S = 1.0  # how often the cachemgrs' unreadable models are looked at
# how long a cachemgr may take to answer that (one that died is not waited for)
POLL_TIMEOUT_S = 2.0

Apply = Callable[[str, str | None], None]


class Quarantine:
    """The unreadable models this backend knows, and the front's ``apply`` for them.

    ``lifted``: name -> when (wall clock) a reload last lifted its quarantine; a report
    asked for before then (a cachemgr's poll that crossed the reload) is ignored."""

    def __init__(self) -> None:
        self.models: dict[str, str] = {}
        self.lifted: dict[str, float] = {}
        self._apply: Apply | None = None

    def follow(self, apply: Apply) -> None:
        """``apply(name, why | None)`` for every change (and now for what is known)."""
        self._apply = apply
        for name, why in self.models.items():
            apply(name, why)

    def set(self, name: str, why: str, asked_at: float | None = None) -> bool:
        """``name`` cannot be read (``why``; learnt from a report asked for at
        ``asked_at``); True if that is news. The first error stands until a reload."""
        if name in self.models or (asked_at is not None
                                   and asked_at < self.lifted.get(name, 0.0)):  # fmt: skip
            return False
        self.models[name] = why
        log.error("model_unavailable", model=name, error=why)
        self._tell(name, why)
        return True

    def sync(self, models: dict[str, str], lifted: dict[str, float]) -> None:
        """Become ``models`` (the set the replicas share), telling the front each change."""
        self.lifted.update(lifted)
        for name in [n for n in self.models if n not in models]:
            self.models.pop(name)
            self._tell(name, None)
        for name, why in models.items():
            if self.models.get(name) != why:
                self.models[name] = why
                self._tell(name, why)

    def _tell(self, name: str, why: str | None) -> None:
        if self._apply is not None:
            self._apply(name, why)
