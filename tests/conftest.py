"""Fixtures shared by every test directory."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from market_support import kept_root, market_cache

# Which worker runs what (`--dist loadgroup`): a module's tests on one worker, the
# modules that share the `served` node one after another on one worker, chaos last;
# a test marked `alone` while the other worker runs none.
from worker_groups import pytest_collection_modifyitems, pytest_runtest_protocol

if TYPE_CHECKING:  # the harness imports the node's tooling: only where a test serves
    from serve_harness import Served

# hooks: pytest finds them here by their names
__all__ = ["pytest_collection_modifyitems", "pytest_runtest_protocol"]

E2E_MODELS = 4  # the "small" profile cycles its 3 smallest rungs: 3 families, 4 models


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


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread in the tests' own process, as the module found it afterwards: the
    references (transformers, PEFT, the engine in process) step a small model token by
    token, and on a machine busy with a served node's processes (and another xdist
    worker) a second thread only waits on the first (transformers' greedy 32 tokens of
    SmolLM2: 14 s on two threads, 4 s on one, on the 2-core CI machine). Every e2e module
    takes it (tests/e2e/conftest.py), and the modules elsewhere that run such references."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def small_market() -> Path:
    """The e2e tests' 4-model market of the ``small`` profile, kept across sessions."""
    from aegaeon_market import ensure_market

    market = kept_root() / f"aegaeon-e2e-market-{os.getuid()}-small{E2E_MODELS}"
    ensure_market(market, num_models=E2E_MODELS, profile="small", progress=False)
    return market


@pytest.fixture(scope="session")
def market_names(small_market: Path) -> list[str]:
    """The names of :func:`small_market`'s models, in its order."""
    return [m["name"] for m in json.loads((small_market / "market.json").read_text())["models"]]


@pytest.fixture(scope="session")
def served(small_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`aegaeon serve` of :func:`small_market` with the default config, shared by the
    modules of :data:`worker_groups.SHARED_NODE_MODULES`; stopped, and `serving`'s checks
    made (exit 0, no process and no shared memory left), after the last test in a row
    that uses it (see :func:`pytest_runtest_teardown`), not at the end of the session."""
    from serve_harness import serving

    with serving(small_market, tmp_path_factory.mktemp("serve") / "run") as node:
        yield node


# the session fixtures of a node shared by a group of modules (worker_groups.NODE_GROUPS):
# `served` here, `real_served` in tests/e2e/conftest.py
SHARED_NODE_FIXTURES = ("served", "real_served")


def _shared_node(item: pytest.Item) -> Any:
    """The definition of the session-scoped shared node ``item`` uses, if any (a module
    may define a `served` of its own: that one is not a shared node)."""
    info = getattr(item, "_fixtureinfo", None)
    for name in SHARED_NODE_FIXTURES:
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and defs[-1].scope == "session":
            return defs[-1]
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop a shared node once the next test does not use it: a session fixture would
    otherwise idle beside every later test on the worker, and its checks would fail the
    worker's last test. A failed check fails this test's teardown."""
    result = yield
    node = _shared_node(item)
    last = nextitem is None or _shared_node(nextitem) is not node
    if node is not None and node.cached_result is not None and last:
        node.finish(item._request)  # type: ignore[attr-defined]
    return result
