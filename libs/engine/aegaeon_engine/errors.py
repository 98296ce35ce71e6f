"""Errors raised by the engine (no torch import: the spec and layout use them)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served.

    Always names the file and the field (config key or tensor name) at fault, so
    an operator can fix the checkpoint without reading a traceback.
    """

    def __init__(self, path: str | Path, field: str | None, message: str) -> None:
        self.path = str(path)
        self.field = field
        self.reason = message
        where = f"{self.path}: {field}" if field else self.path
        super().__init__(f"{where}: {message}")
