"""A fingerprint of the code that makes a market, recorded in ``market.json``.

Markets are cached (tests, benchmarks, ``/tmp``); a market written by other
market code may hold other names, tokenizers or weights. `ensure_market`
compares fingerprints and rebuilds stale markets. Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

_PACKAGE_DIR = Path(__file__).parent
# libraries whose versions can change the bytes (random streams, BPE training)
_LIBRARIES = ("torch", "tokenizers", "safetensors")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


@functools.cache
def market_fingerprint() -> str:
    """16 hex digits over this package's files and the versions of its libraries."""
    digest = hashlib.sha256()
    for dist in _LIBRARIES:
        digest.update(f"{dist}={_version(dist)};".encode())
    files = (p for p in _PACKAGE_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in sorted(files):
        digest.update(path.relative_to(_PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
