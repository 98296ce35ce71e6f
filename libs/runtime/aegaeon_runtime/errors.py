"""Errors the compute loops tell apart."""

from __future__ import annotations


class ModelGoneError(RuntimeError):
    """The node's cachemgr no longer holds the model: it was removed at run time
    (through another proxy replica, while work for it was on its way here). The work
    for it fails with ``unknown_model``; the instance lives."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"model {name!r} is no longer served: {why}")
        self.model = name
