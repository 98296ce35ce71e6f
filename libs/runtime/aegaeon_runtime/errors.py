"""Errors the compute loops tell apart."""

from __future__ import annotations


class ModelGoneError(RuntimeError):
    """The node's cachemgr no longer holds the model: it was removed at run time
    (through another proxy replica, while work for it was on its way here). The work
    for it fails with ``unknown_model`` (:attr:`code`); the instance lives."""

    code = "unknown_model"
    what = "is no longer served"

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"model {name!r} {self.what}: {why}")
        self.model = name
        self.why = why

    @property
    def message(self) -> str:
        """What the work for it fails with."""
        return str(self)


class ModelUnavailableError(ModelGoneError):
    """The node's cachemgr cannot read the model's checkpoint (``checkpoint_error``: a
    missing, truncated or corrupt file). The work for it fails with
    ``model_unavailable``, naming the file; the instance lives and serves the rest."""

    code = "model_unavailable"
    what = "is unavailable"

    @property
    def message(self) -> str:
        return self.why  # the cachemgr's words: the file and what is wrong with it
