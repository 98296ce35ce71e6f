"""Measurements kept across runs (start-up profiles, kernel choices): what identifies
the machine and the code they were taken on, and files written atomically.

A kept measurement is valid for one machine (CPU model and features, core
count), one version of the code that measured it and the settings it ran
under; each user hashes those into a file name. Files are written aside and
renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import tempfile
from pathlib import Path


def cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), else what platform knows."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model.strip():
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}|{os.cpu_count()}"


def code_digest(packages: tuple[str, ...]) -> str:
    """A digest of the sources (.py, .cpp, .h) of ``packages``."""
    digest = hashlib.sha256()
    for name in packages:
        root = Path(importlib.import_module(name).__file__ or "").parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and path.is_file():
                digest.update(path.relative_to(root).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _aside(path: Path, text: str) -> str:
    """``text`` written to a temporary file beside ``path``; its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (a temporary file, then rename), readable by this user
    only (0600, as ``mkstemp`` makes it: a config may hold API keys)."""
    tmp = _aside(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_first(path: Path, text: str) -> str:
    """Write ``text`` to ``path`` unless another writer got there first; the text in
    force either way (processes that measured at once agree on the first result)."""
    tmp = _aside(path, text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        try:
            return path.read_text()
        except OSError:
            os.replace(tmp, path)
            tmp = ""
    finally:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
    return text
