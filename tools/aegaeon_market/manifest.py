"""``market.json``: written here, last and atomically; read by everyone through
:mod:`aegaeon_common.market_index` (its reader and entries)."""

from __future__ import annotations

import os
from pathlib import Path

from aegaeon_common.market_index import MANIFEST, Manifest, MarketEntry, MarketError, load_market
from aegaeon_common.owner import stamp

from aegaeon_market.plan import ROLE_BENCH


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Replace ``root/market.json`` atomically: readers see the old file or the new one."""
    tmp = root / f".{MANIFEST}.{stamp()}.tmp"  # whose, for `market gc` (leftovers.py)
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(manifest.to_json(root))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)


def market_model(market_dir: Path | str, name: str) -> MarketEntry:
    """The model called ``name``; `MarketError` naming the market's models otherwise."""
    entries = load_market(market_dir)
    for entry in entries:
        if entry.name == name:
            return entry
    known = ", ".join(e.name for e in entries) or "none"
    raise MarketError(f"{Path(market_dir) / MANIFEST}: no model named {name!r} and no such "
                      f"directory (the market has: {known})")


def default_bench_model(market_dir: Path | str) -> MarketEntry:
    """The market's mid-size benchmark model (role ``bench``; else the median size)."""
    entries = load_market(market_dir)
    if not entries:
        raise MarketError(f"{market_dir}: the market has no models")
    for entry in entries:
        if entry.role == ROLE_BENCH:
            return entry
    return sorted(entries, key=lambda e: e.params)[(len(entries) - 1) // 2]
