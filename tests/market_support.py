"""Where the tests keep the markets they build, across sessions."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def market_cache(pytestconfig: pytest.Config) -> Path:
    """Where markets are kept across sessions: ``.pytest_cache/d/aegaeon-market``, or,
    with the cache plugin off (``-p no:cacheprovider``), ``$AEGAEON_TEST_CACHE`` (default:
    the temp folder) like the e2e markets. `ensure_market` rebuilds a market there when
    the market code changed and is safe when several sessions ask at once (it builds
    aside and renames into place)."""
    cache = getattr(pytestconfig, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("aegaeon-market"))
    root = Path(os.environ.get("AEGAEON_TEST_CACHE", tempfile.gettempdir()))
    base = root / f"aegaeon-test-markets-{os.getuid()}"
    base.mkdir(parents=True, exist_ok=True)
    return base
