"""Fixtures of the e2e tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from real_market import real_market_dir
from serve_harness import Served, serving


@pytest.fixture(scope="session")
def real_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`aegaeon serve` of the real-model market (real_market.py) with the default config,
    shared by the modules of :data:`worker_groups.REAL_NODE_MODULES`, which run one after
    another on one worker; stopped, and `serving`'s checks made, after the last test in a
    row that uses it (tests/conftest.py's `pytest_runtest_teardown`)."""
    with serving(real_market_dir(), tmp_path_factory.mktemp("serve-real") / "run") as node:
        yield node


@pytest.fixture(scope="module", autouse=True)  # before the module's own fixtures
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every e2e module on one torch thread (tests/conftest.py's `one_torch_thread`)."""
