"""What unfinished market writers leave behind, found and removed (``aegaeon market gc``).

A market changes through private, stamped names (``aegaeon_common.owner``:
``HOST-TAG.PID``, the writer's machine and process); a writer that is killed
(SIGKILL, an OOM kill, a reboot) leaves them behind, gigabytes for a large model:

| where | name | left by |
|---|---|---|
| the market | ``.add-NAME.STAMP.tmp`` | ``market add``: the model being written |
| the market | ``.old-NAME.STAMP`` | ``market add --replace``: the model it replaces |
| the market | ``.removed-NAME.STAMP`` | ``market remove``: the model being deleted |
| the market | ``.market.json.STAMP.tmp`` | any change: the index being written |
| beside the market | ``.MARKET.STAMP.tmp`` / ``.old`` | ``market create``: the market built aside |
| the wheel cache | ``.download-STAMP.*`` / ``.extract-STAMP.*`` | the default models' download |
| /dev/shm | ``aegaeon-RUN-STAMP-*`` | the cachemgr: Model Cache and KV segments |

:func:`sweep` removes each one whose writer is gone: its PID no longer runs
here. Where the PID cannot be checked (the stamp is another machine's, another
container's or an earlier boot's; or a name from before stamps, PID alone) a
leftover is removed once nothing in it was written for ``stale_after_s``: a
writer still at work writes all the time. A live writer's files are never
touched. A replace cut short between its two renames (the model folder moved
aside, the new one not yet in place) is put back, not removed. Segments whose
writer cannot be checked are left alone (they may be a live node's memory).

Every market command sweeps the market's and the wheel cache's first
(``aegaeon_market.cli``, under the market's lock); ``market gc`` sweeps the
segments too.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from aegaeon_common.owner import OwnerState, Stamp, owner_state, parse_stamp

STALE_AFTER_S = 3600.0  # a leftover nobody can vouch for, unwritten this long, is removed
SHM_DIR = Path("/dev/shm")
MANIFEST = "market.json"

Action = Literal["remove", "restore", "keep"]
# a writer's stamp (HOST-TAG.PID), or a PID alone (names from before stamps)
_WHOSE = r"(?:(?P<stamp>[A-Za-z0-9-]+\.[0-9]+)|[0-9]+)"
# in the market: (kind, pattern); a name group is the model's (the shortest that fits)
_IN_MARKET = (
    ("add", re.compile(rf"\.add-(?P<name>.+?)\.{_WHOSE}\.tmp")),
    ("replace", re.compile(rf"\.old-(?P<name>.+?)\.{_WHOSE}")),
    ("remove", re.compile(rf"\.removed-(?P<name>.+?)\.{_WHOSE}")),
    ("index", re.compile(rf"\.{re.escape(MANIFEST)}\.{_WHOSE}\.tmp")),
)
_CACHE = re.compile(r"\.(?P<kind>download|extract)-(?:(?P<stamp>[A-Za-z0-9-]+\.[0-9]+)\.)?"
                    r"[A-Za-z0-9_]+")  # fmt: skip
_SEGMENT = re.compile(r"aegaeon-[0-9a-f]{8}-(?P<tag>[A-Za-z0-9-]+)\.(?P<pid>[0-9]+)-.+")


@dataclass(frozen=True)
class Leftover:
    """A file or folder an unfinished writer left: where, what kind, whose (None: a PID
    or nothing that can be checked), its bytes and when it was last written."""

    path: Path
    kind: str
    owner: Stamp | None
    nbytes: int
    last_written_s: float
    model: str = ""  # the model it belongs to (add, replace, remove)


@dataclass(frozen=True)
class Verdict:
    leftover: Leftover
    action: Action
    reason: str


@dataclass
class Sweep:
    """What a sweep did: removed (and bytes freed), put back, and kept (with why)."""

    removed: list[Verdict] = field(default_factory=list)
    restored: list[Verdict] = field(default_factory=list)
    kept: list[Verdict] = field(default_factory=list)
    dry_run: bool = False

    @property
    def freed_bytes(self) -> int:
        return sum(v.leftover.nbytes for v in self.removed)

    def summary(self) -> str | None:
        """One line: what was removed (or would be, in a dry run) and the bytes freed; None
        when nothing was removed or put back."""
        parts = []
        if self.removed:
            names = ", ".join(f"{v.leftover.path.name} ({v.reason})" for v in self.removed)
            verb = "would remove" if self.dry_run else "removed"
            count = len(self.removed)
            parts.append(f"{verb} {count} leftover{'s' if count > 1 else ''} of unfinished "
                         f"runs, {format_bytes(self.freed_bytes)} "
                         f"{'to free' if self.dry_run else 'freed'}: {names}")  # fmt: skip
        if self.restored:
            names = ", ".join(f"{v.leftover.model} ({v.reason})" for v in self.restored)
            parts.append(f"{'would put back' if self.dry_run else 'put back'} {names}")
        return "; ".join(parts) or None

    def kept_lines(self) -> list[str]:
        """One line per leftover kept, with why (``market list`` and ``gc`` show them)."""
        return [f"{v.leftover.path} ({format_bytes(v.leftover.nbytes)}): kept, {v.reason}"
                for v in self.kept]  # fmt: skip


def format_bytes(nbytes: int) -> str:
    """``2,345,678,901 bytes (2.2 GiB)``."""
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    human = f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
    return f"{nbytes:,} bytes" + ("" if unit == "B" else f" ({human})")


def measure(path: Path) -> tuple[int, float]:
    """Bytes of the files under ``path`` (itself if a file) and the newest write to it or
    anything under it (a folder's time changes as entries come and go)."""
    try:
        info = path.lstat()
    except OSError:
        return 0, 0.0
    if not path.is_dir() or path.is_symlink():
        return info.st_size, info.st_mtime
    nbytes, newest = 0, info.st_mtime
    for folder, _, files in os.walk(path):
        paths = [Path(folder)] + [Path(folder, name) for name in files]
        for item in paths:
            try:
                item_info = item.lstat()
            except OSError:
                continue  # removed meanwhile
            newest = max(newest, item_info.st_mtime)
            nbytes += item_info.st_size if item != Path(folder) else 0
    return nbytes, newest


def _leftover(path: Path, kind: str, match: re.Match[str], model: str = "") -> Leftover:
    groups = match.groupdict()
    owner = parse_stamp(groups["stamp"]) if groups.get("stamp") else None
    nbytes, newest = measure(path)
    return Leftover(path, kind, owner, nbytes, newest, model)


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def find(market: Path, cache_dir: Path | None = None) -> Iterator[Leftover]:
    """Every leftover of ``market`` (in it, and its own build folders beside it) and of
    the wheel cache ``cache_dir``."""
    for path in _entries(market):
        for kind, pattern in _IN_MARKET:
            match = pattern.fullmatch(path.name)
            if match:
                yield _leftover(path, kind, match, match.groupdict().get("name") or "")
                break
    build = re.compile(rf"\.{re.escape(market.name)}\.{_WHOSE}\.(?:tmp|old)")
    for path in _entries(market.parent):
        match = build.fullmatch(path.name)
        if match:
            yield _leftover(path, "create", match)
    for path in _entries(cache_dir) if cache_dir is not None else []:
        match = _CACHE.fullmatch(path.name)
        if match:
            yield _leftover(path, match.group("kind"), match)


def find_segments(shm_dir: Path = SHM_DIR) -> Iterator[Leftover]:
    """The cachemgrs' shared-memory segments (each names its writer)."""
    for path in _entries(shm_dir):
        match = _SEGMENT.fullmatch(path.name)
        if match:
            owner = Stamp(match.group("tag"), int(match.group("pid")))
            nbytes, newest = measure(path)
            yield Leftover(path, "segment", owner, nbytes, newest)


def judge(item: Leftover, market: Path, stale_after_s: float, now_s: float) -> Verdict:
    """What to do with ``item``: remove it, put it back (a replace cut short), or keep it."""
    owner = item.owner
    state: OwnerState = owner_state(owner, item.last_written_s) if owner else "unknown"
    idle_s = max(0.0, now_s - item.last_written_s)
    if state == "alive" and owner is not None:
        return Verdict(item, "keep", f"its {item.kind} is running (pid {owner.pid})")
    if state == "gone" and owner is not None:
        why = f"{item.kind}, pid {owner.pid} gone"
    elif item.kind == "segment":
        return Verdict(item, "keep", "its cachemgr runs elsewhere (not checked)")
    elif idle_s < stale_after_s:
        whose = (f"written on {owner.tag}" if owner
                 else "its pid cannot be checked (an older name)")  # fmt: skip
        return Verdict(item, "keep", f"{whose}, {idle_s:.0f} s ago; removed once unwritten "
                                     f"for {stale_after_s:.0f} s")  # fmt: skip
    else:
        why = f"{item.kind}, unwritten for {idle_s:.0f} s"
    if item.kind == "replace" and item.path.is_dir() and not (market / item.model).exists():
        return Verdict(item, "restore", f"{item.kind} cut short")
    return Verdict(item, "remove", why)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def sweep(market: Path, cache_dir: Path | None = None, *, shm_dir: Path | None = None,
          stale_after_s: float = STALE_AFTER_S, dry_run: bool = False,
          now_s: float | None = None) -> Sweep:
    """Remove (``dry_run``: only say) the leftovers whose writers are gone: the market's,
    the wheel cache's (``cache_dir``) and the cachemgrs' segments in ``shm_dir``
    (``SHM_DIR``: ``market gc`` only). Hold the market's lock (``edit.market_lock``)
    when ``market`` exists."""
    now_s = time.time() if now_s is None else now_s
    market = Path(market)
    found = list(find(market, cache_dir))
    if shm_dir is not None:
        found += find_segments(shm_dir)
    out = Sweep(dry_run=dry_run)
    for item in found:
        verdict = judge(item, market, stale_after_s, now_s)
        if verdict.action == "keep" or dry_run:
            {"keep": out.kept, "remove": out.removed, "restore": out.restored}[
                verdict.action].append(verdict)
            continue
        try:
            if verdict.action == "restore":
                os.rename(item.path, market / item.model)
                out.restored.append(verdict)
            else:
                _remove(item.path)
                out.removed.append(verdict)
        except FileNotFoundError:
            continue  # another sweep got there first
        except OSError as exc:
            out.kept.append(Verdict(item, "keep", f"cannot remove it: "
                                                  f"{exc.strerror or exc}"))  # fmt: skip
    if shm_dir is not None:  # live segments are a node's memory, not leftovers to show
        out.kept = [v for v in out.kept if v.leftover.kind != "segment"]
    return out


def parse_age(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` -> seconds; ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise ValueError(f"expected a duration like 90s, 30m, 2h or 1d, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
