"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from market_support import market_cache


def pytest_configure(config: pytest.Config) -> None:
    # `--dist loadscope` (scripts/test) sends whole modules to a worker, by default the
    # modules with the most tests first: the one-test modules, the longest (a whole
    # gpu-check dry run, the chaos run), came last, where one worker ran them while the
    # other had nothing left. Collection order puts tests/e2e and tests/integration (the
    # modules that start services) first and the many short unit modules last, to even out.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """This process's logging as it was before the test: a test that runs a command in
    process which configures it (``main(["serve", ...])``: `setup_logging`) would leave
    the root logger at INFO writing to that test's captured stderr, and every later test
    on the worker would find library lines (or "Logging error"s) in its own stderr."""
    import logging

    import structlog

    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    root.handlers, root.level = handlers, level
    structlog.configure(**config)


@pytest.fixture(scope="session")
def default_market(pytestconfig: pytest.Config) -> Path:
    """The default 8-model market (seed 0, bfloat16), built once and reused across
    sessions (in `market_cache`)."""
    from aegaeon_market import ensure_market

    market = market_cache(pytestconfig) / "default"
    ensure_market(market, num_models=8, seed=0, progress=False)
    return market


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server for this session (see tests/redis_support.py)."""
    from redis_support import running_redis

    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
