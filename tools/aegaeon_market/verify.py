"""``aegaeon market verify``: every model's files against what ``market.json`` records.

A model added by the market tools has each file's size and SHA-256 recorded; one
whose file went missing, changed size or content since (a partial copy, a full
disk during a sync, disk rot) is bad, with the first such file named. A model
listed before the records existed (or by hand) is checked for what the engine
reads: its config and every tensor's name, shape, dtype and bytes inside its file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aegaeon_common.market_files import digest_problem
from aegaeon_common.market_index import MANIFEST, MarketEntry, MarketError, read_manifest

__all__ = ["Verdict", "verify_market"]


@dataclass(frozen=True)
class Verdict:
    """One model checked: ``problem`` is None when it is as recorded; ``recorded``:
    its files had sizes and digests to check (else only its structure was)."""

    entry: MarketEntry
    problem: str | None
    recorded: bool


def _structure_problem(entry: MarketEntry) -> str | None:
    from aegaeon_engine.errors import CheckpointError
    from aegaeon_engine.layout import weight_layout
    from aegaeon_engine.loader import check_checkpoint
    from aegaeon_engine.spec import ModelSpec

    try:
        spec = ModelSpec.from_dir(entry.path)
        check_checkpoint(entry.path, weight_layout(spec))
    except (CheckpointError, OSError, ValueError) as exc:
        return str(exc)
    return None


def verify_market(market_dir: Path | str, names: Sequence[str] = ()) -> list[Verdict]:
    """Check the models called ``names`` (default: every model) of the market in
    ``market_dir``; `MarketError` for an unreadable market or an unknown name."""
    root = Path(market_dir).resolve()
    entries = read_manifest(root).entries
    by_name = {e.name: e for e in entries}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        known = ", ".join(by_name) or "none"
        raise MarketError(f"{root / MANIFEST}: no model named {unknown[0]!r} (the market has: "
                          f"{known})")
    picked = [by_name[n] for n in dict.fromkeys(names)] if names else list(entries)
    out = []
    for entry in picked:
        if entry.files:
            out.append(Verdict(entry, digest_problem(entry.path, entry.files), True))
        else:
            out.append(Verdict(entry, _structure_problem(entry), False))
    return out
