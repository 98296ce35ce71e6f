"""Where the tests keep the markets they build, across sessions."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def kept_root() -> Path:
    """Where the tests keep what they build across sessions (the e2e markets, the
    transformers references): ``$AEGAEON_TEST_CACHE``, by default the temp folder."""
    return Path(os.environ.get("AEGAEON_TEST_CACHE", tempfile.gettempdir()))


def market_cache(pytestconfig: pytest.Config) -> Path:
    """Where markets are kept across sessions: ``.pytest_cache/d/aegaeon-market``, or,
    with the cache plugin off (``-p no:cacheprovider``), ``$AEGAEON_TEST_CACHE`` (default:
    the temp folder) like the e2e markets. `ensure_market` rebuilds a market there when
    the market code changed and is safe when several sessions ask at once (it builds
    aside and renames into place)."""
    cache = getattr(pytestconfig, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("aegaeon-market"))
    base = kept_root() / f"aegaeon-test-markets-{os.getuid()}"
    base.mkdir(parents=True, exist_ok=True)
    return base


# ---- markets with broken checkpoints (what a partial copy or disk rot leaves) ---------
def linked_copy(src: Path, dest: Path, private: tuple[str, ...] = ()) -> Path:
    """A copy of the market ``src`` at ``dest`` whose files are hard links (the same
    file system; copies where that fails), but for the models named in ``private``,
    copied: those may be broken without touching ``src``."""
    import os
    import shutil

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dest, copy_function=link)
    for name in private:
        shutil.rmtree(dest / name)
        shutil.copytree(src / name, dest / name)
    return dest


def with_records(market: Path) -> Path:
    """Record every model's files (size, sha256) in ``market``'s ``market.json``, as the
    market tools do when they write a model (a cached market may predate that)."""
    from dataclasses import replace

    from aegaeon_common.market_files import record_files
    from aegaeon_common.market_index import read_manifest

    manifest = read_manifest(market)
    entries = tuple(replace(e, files=record_files(e.path)) for e in manifest.entries)
    (market / "market.json").write_text(replace(manifest, entries=entries).to_json(market))
    return market


def truncate(path: Path, nbytes: int = 1 << 20) -> None:
    """Cut ``path`` to its first ``nbytes`` bytes."""
    with path.open("r+b") as f:
        f.truncate(nbytes)


def swap_a_shape(path: Path) -> str:
    """Rewrite the header of the safetensors file at ``path`` so that one 2-D tensor's
    shape is transposed: the same bytes, the same file size, the header still valid
    JSON, but a shape the model's config does not give. Returns that tensor's name."""
    import json

    with path.open("r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        name = next(n for n, t in sorted(header.items())
                    if n != "__metadata__" and len(t["shape"]) == 2
                    and t["shape"][0] != t["shape"][1])  # fmt: skip
        header[name]["shape"] = header[name]["shape"][::-1]
        raw = json.dumps(header, separators=(",", ":")).encode()
        assert len(raw) <= length
        f.seek(8)
        f.write(raw.ljust(length))  # safetensors pads its header with spaces
    return name


def flip_a_byte(path: Path) -> None:
    """Change one byte of the tensor data of the safetensors file at ``path`` (the last
    one): header, shapes and size as they were, the content not."""
    with path.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0xFF]))
