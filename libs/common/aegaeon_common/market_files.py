"""A model's files against what ``market.json`` records of them (size, SHA-256).

The market tools record every file of a model when they write it
(``aegaeon_market``); a file that changed afterwards (a partial copy, a full
disk during a sync, disk rot) is caught here: :func:`size_problem` is a stat
per file (``aegaeon serve`` and the cachemgr at start), :func:`digest_problem`
reads every byte (``aegaeon market verify``; the cachemgr checks the weight
files while it reads them into the Model Cache, the others here).
:class:`MarketRecords` finds a served model's records by its directory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from aegaeon_common.market_index import MANIFEST, FileRecord, MarketError, read_manifest

__all__ = ["MarketRecords", "Signature", "digest_mismatch", "digest_problem", "file_sha256",
           "record_files", "size_problem", "stat_signature"]  # fmt: skip


def file_sha256(path: Path) -> str:
    """The SHA-256 (hex) of the file at ``path`` (``OSError`` if unreadable)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def record_files(model_dir: Path) -> tuple[FileRecord, ...]:
    """Every regular file below ``model_dir`` with its size and SHA-256, by name."""
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return tuple(FileRecord(p.relative_to(root).as_posix(), p.stat().st_size, file_sha256(p))
                 for p in files)  # fmt: skip


def size_problem(model_dir: Path, files: Iterable[FileRecord]) -> str | None:
    """What is wrong with the sizes of ``files`` in ``model_dir`` (the first missing or
    resized file, named), or None. A stat per file."""
    for record in files:
        path = Path(model_dir) / record.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{path}: missing file (market.json records {record.size} bytes)"
        except OSError as exc:
            return f"{path}: cannot read ({exc.strerror})"
        if size != record.size:
            return f"{path}: {size} bytes, market.json records {record.size}"
    return None


def digest_problem(model_dir: Path, files: Iterable[FileRecord]) -> str | None:
    """:func:`size_problem`, then the first file whose content differs from its recorded
    SHA-256, named; or None. Reads every byte of ``files``."""
    files = list(files)
    problem = size_problem(model_dir, files)
    if problem is not None:
        return problem
    for record in files:
        path = Path(model_dir) / record.name
        try:
            digest = file_sha256(path)
        except OSError as exc:
            return f"{path}: cannot read ({exc.strerror})"
        if digest != record.sha256:
            return f"{path}: {digest_mismatch(digest, record.sha256)}"
    return None


def digest_mismatch(got: str, recorded: str) -> str:
    """What is said of a file whose content changed (the same words everywhere)."""
    return (f"content differs from what market.json records (sha256 {got[:12]}..., "
            f"recorded {recorded[:12]}...)")


Signature = tuple[tuple[str, int, int], ...]


def stat_signature(model_dir: Path, files: Iterable[FileRecord]) -> Signature:
    """(name, size, mtime_ns) of each of ``files`` now (-1, -1 where unreadable): a file
    changed since it was checked when its signature differs."""
    out = []
    for record in files:
        try:
            info = (Path(model_dir) / record.name).stat()
            out.append((record.name, info.st_size, info.st_mtime_ns))
        except OSError:
            out.append((record.name, -1, -1))
    return tuple(out)


class MarketRecords:
    """The file records of the models of the market in ``market_dir`` (None: no market,
    nothing recorded), by model directory; ``market.json`` is read again whenever it
    changed (a model added or replaced since: ``market add --replace`` records its new
    files), checked by a stat per lookup."""

    def __init__(self, market_dir: Path | None) -> None:
        self._market = market_dir
        self._by_dir: dict[Path, tuple[FileRecord, ...]] = {}
        self._seen: tuple[int, int] | None = None  # market.json's (mtime_ns, size) read
        self.refresh()

    def _stamp(self) -> tuple[int, int] | None:
        if self._market is None:
            return None
        try:
            info = (self._market / MANIFEST).stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def refresh(self) -> None:
        """Read ``market.json`` again (an unreadable one records nothing); the records are
        replaced whole (a lookup on another thread sees the old or the new)."""
        self._seen = self._stamp()
        by_dir: dict[Path, tuple[FileRecord, ...]] = {}
        if self._market is not None:
            try:
                manifest = read_manifest(self._market)
            except MarketError:
                manifest = None
            if manifest is not None:
                by_dir = {e.path.resolve(): e.files for e in manifest.entries}
        self._by_dir = by_dir

    def files(self, model_dir: Path) -> tuple[FileRecord, ...]:
        """What the market records of the model in ``model_dir`` now (() if nothing)."""
        if self._stamp() != self._seen:
            self.refresh()
        return self._by_dir.get(Path(model_dir).resolve(), ())
