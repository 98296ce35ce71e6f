"""Open a GGUF file with the ``gguf`` package and read its metadata with checked types.

Every defect is a `CheckpointError` naming the file and the key (or tensor):
a wrong magic, a truncated file, an unknown tensor type, a key of the wrong
type. The reader maps the file; tensor data is read only when asked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from aegaeon_engine.errors import CheckpointError
from gguf import GGUFReader, GGUFValueType, ReaderTensor

_MISSING: Any = object()


class GGUFFile:
    """A GGUF file's metadata (typed access) and tensors by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise CheckpointError(path, None, "missing file")
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(path, "magic", f"not a GGUF file (starts with {magic!r}, "
                                  "expected b'GGUF')")
        try:
            self.reader = GGUFReader(path)
        except (ValueError, IndexError, KeyError, OverflowError, OSError) as exc:
            raise CheckpointError(path, None, _reader_problem(exc)) from None
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture", str)

    def get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """The value of ``key`` as ``kind`` (``int``, ``float``, ``str``, ``bool``, ``list``)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise CheckpointError(self.path, key, "missing")
            return default
        is_array = field.types[0] == GGUFValueType.ARRAY
        if (kind is list) != is_array:
            shape = "an array" if is_array else "a single value"
            raise CheckpointError(self.path, key, f"is {shape}, expected {kind.__name__}")
        try:
            value = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CheckpointError(self.path, key, f"unreadable value ({exc})") from None
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if not isinstance(value, kind):
            raise CheckpointError(self.path, key, f"expected {kind.__name__}, got {value!r}")
        return value

    def arch_get(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """``get`` of ``<architecture>.<key>`` (``llama.block_count``)."""
        return self.get(f"{self.arch}.{key}", kind, default)

    def tensor(self, name: str) -> ReaderTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise CheckpointError(self.path, name, "missing tensor")
        return tensor


def _reader_problem(exc: Exception) -> str:
    """One line about why the ``gguf`` reader refused the file."""
    text = str(exc)
    unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", text)
    if unknown:
        return f"a tensor has unknown GGML type {unknown.group(1)} (newer than this gguf reader?)"
    if "cannot reshape" in text or "out of bounds" in text or isinstance(exc, IndexError):
        return f"truncated or corrupt GGUF file ({text})"
    return f"unreadable GGUF file ({text or type(exc).__name__})"
