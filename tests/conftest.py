"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from market_support import market_cache

if TYPE_CHECKING:  # the harness imports the node's tooling: only where a test serves
    from serve_harness import Served

# The modules whose tests share one `aegaeon serve` of the default config (the session
# fixture `served` below), in the order they run: together, so that the node starts once
# (one pytest-xdist work unit: one worker runs them all), and the chaos run, which kills
# every service in turn, last. Each leaves the node serving and holding nothing, as the
# next one needs it (the chaos run and the rolling restart check that it does).
SHARED_NODE_MODULES = (
    "tests/e2e/test_serve_openai.py",
    "tests/e2e/test_serve_classes.py",
    "tests/e2e/test_serve_observability.py",
    "tests/e2e/test_prometheus.py",
    "tests/integration/test_bench_serve.py",
    "tests/e2e/test_docs.py",
    "tests/e2e/test_chaos.py",
)
SHARED_NODE_SCOPE = "shared-node"
E2E_MODELS = 4  # the "small" profile cycles its 3 smallest rungs: 3 families, 4 models


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    # `--dist loadscope` (scripts/test) sends whole modules to a worker, by default the
    # modules with the most tests first: the one-test modules, the longest (a whole
    # gpu-check dry run, the chaos run), came last, where one worker ran them while the
    # other had nothing left. Collection order puts tests/e2e and tests/integration (the
    # modules that start services) first and the many short unit modules last, to even out.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of :data:`SHARED_NODE_MODULES` one after another, in its order, where the
    first of them was collected (every worker reorders its collection the same way)."""
    rank = {module: k for k, module in enumerate(SHARED_NODE_MODULES)}
    shared = [item for item in items if _module(item.nodeid) in rank]
    if not shared:
        return
    at = items.index(shared[0])
    rest = [item for item in items if _module(item.nodeid) not in rank]
    shared.sort(key=lambda item: rank[_module(item.nodeid)])  # stable: a module's own order
    items[:] = [*rest[:at], *shared, *rest[at:]]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with the :data:`SHARED_NODE_MODULES` as one scope: one worker
    runs them all, one after another, on one node."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedNodeScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if _module(nodeid) in SHARED_NODE_MODULES:
                return SHARED_NODE_SCOPE
            return str(super()._split_scope(nodeid))

    return SharedNodeScheduling(config, log)


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


@pytest.fixture(scope="session")
def small_market() -> Path:
    """The e2e tests' 4-model market of the ``small`` profile, kept across sessions."""
    from aegaeon_market import ensure_market

    root = Path(os.environ.get("AEGAEON_TEST_CACHE", tempfile.gettempdir()))
    market = root / f"aegaeon-e2e-market-{os.getuid()}-small{E2E_MODELS}"
    ensure_market(market, num_models=E2E_MODELS, profile="small", progress=False)
    return market


@pytest.fixture(scope="session")
def served(small_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`aegaeon serve` of :func:`small_market` with the default config, shared by the
    :data:`SHARED_NODE_MODULES`; stopped, and `serving`'s checks made (exit 0, no process
    and no shared memory left), after the last test in a row that uses it (see
    :func:`pytest_runtest_teardown`), not at the end of the session."""
    from serve_harness import serving

    with serving(small_market, tmp_path_factory.mktemp("serve") / "run") as node:
        yield node


def _shared_node(item: pytest.Item) -> Any:
    """The session-scoped `served` fixture's definition ``item`` uses, if any (a module
    may define a `served` of its own: that one is not the shared node)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("served") if info is not None else None
    return defs[-1] if defs and defs[-1].scope == "session" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the shared node once the next test does not use it: a session fixture would
    otherwise idle beside every later test on the worker, and its checks would fail the
    worker's last test. A failed check fails this test's teardown."""
    result = yield
    node = _shared_node(item)
    last = nextitem is None or _shared_node(nextitem) is not node
    if node is not None and node.cached_result is not None and last:
        node.finish(item._request)  # type: ignore[attr-defined]
    return result
