"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_market(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default 8-model market (seed 0, bfloat16), built once and reused across sessions.

    Lives in ``.pytest_cache/d/aegaeon-market/default``. `ensure_market`
    rebuilds it when the market code changed and is safe when several
    sessions ask at once (it builds aside and renames into place).
    """
    from aegaeon_market import ensure_market

    cache = getattr(pytestconfig, "cache", None)
    base = cache.mkdir("aegaeon-market") if cache is not None else tmp_path_factory.mktemp("m")
    market = base / "default"
    ensure_market(market, num_models=8, seed=0, progress=False)
    return market


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server for this session (see tests/redis_support.py)."""
    from redis_support import running_redis

    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
