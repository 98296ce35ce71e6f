"""Which pytest-xdist worker runs which tests: ``--dist loadgroup`` (pyproject's addopts)
with an ``xdist_group`` mark on every test, put there by :func:`pytest_collection_modifyitems`
(tests/conftest.py takes the hook from here).

- A module's tests form one group, so one worker runs them all and a module-scoped
  fixture (an `aegaeon serve` of its own) starts once.
- The :data:`SHARED_NODE_MODULES` form one group, :data:`SHARED_NODE_GROUP`: they share
  one `aegaeon serve` (the session fixture `served`), which starts once; they run one
  after another in that tuple's order, the chaos run (it kills every service in turn)
  last. Each leaves the node serving and holding nothing, as the next one needs it (the
  chaos run and the rolling restart check that it does).
- The :data:`REAL_NODE_MODULES` form :data:`REAL_NODE_GROUP` the same way: they share
  one `aegaeon serve` of the real-model market (the session fixture `real_served`, the
  same default config each of them served on its own).
- Groups are handed out in collection order (``--no-loadscope-reorder``): tests/e2e and
  tests/integration, whose modules start services and run longest, before the many
  short unit modules, so no long module starts last while the other worker idles. The
  :data:`LONG_UNIT_MODULES` (tens of seconds each) go first among the unit modules, in
  that tuple's order, for the same reason (alphabetically most of them would be last).
- The tests marked ``alone`` go last (:func:`with_alone_last`): see below.

A test that carries an ``xdist_group`` mark of its own keeps it.

A test marked ``alone`` (it compares times it measures) runs while the other worker runs
no test: :func:`pytest_runtest_protocol` has it hold the suite's lock alone, where every
other test shares it (a busy second core, or a node the other worker is starting, would
otherwise disturb its measurement). The other worker waits between two of its tests, its
module's node (if any) idle meanwhile; and the test marked ``alone`` waits for the other
worker's test to end, its own worker idle. Collected last, it waits for one of the short
unit tests that end the run, not for a long e2e one (it had waited 25 s for a gpu-check
dry run in the middle of the run, its worker idle all that time).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import pytest

SHARED_NODE_MODULES = (
    "tests/e2e/test_serve_openai.py",
    "tests/e2e/test_serve_api_surface.py",
    "tests/e2e/test_serve_classes.py",
    "tests/e2e/test_serve_observability.py",
    "tests/e2e/test_prometheus.py",
    "tests/integration/test_bench_serve.py",
    "tests/e2e/test_docs.py",
    "tests/e2e/test_chaos.py",
)
SHARED_NODE_GROUP = "shared-node"
REAL_NODE_MODULES = (
    "tests/e2e/test_real_model_greedy.py",
    "tests/e2e/test_real_model_api.py",
)
REAL_NODE_GROUP = "real-node"
# each group of modules that share one node, by its name
NODE_GROUPS = {SHARED_NODE_GROUP: SHARED_NODE_MODULES, REAL_NODE_GROUP: REAL_NODE_MODULES}
# the slowest unit modules, longest first (a suite run's --durations on a busy 2-core machine)
LONG_UNIT_MODULES = (
    "tests/unit/test_sim_cli.py",
    "tests/unit/test_sim_adapters.py",
    "tests/unit/test_engine_lora_triton.py",
    "tests/unit/test_sim_engine.py",
    "tests/unit/test_triton_kernels.py",
    "tests/unit/test_engine_forward.py",
)
UNIT_DIR = "tests/unit/"


def module_of(nodeid: str) -> str:
    """The module path of a test's node id (``tests/unit/test_x.py::test_y[1]``)."""
    return nodeid.split("::", 1)[0]


def group_of(nodeid: str) -> str:
    """The test's xdist group: the name of its :data:`NODE_GROUPS` group for the modules
    that share a node, else its module's name (unique: the test directories have no
    ``__init__.py``)."""
    module = module_of(nodeid)
    shared = (group for group, modules in NODE_GROUPS.items() if module in modules)
    return next(shared, PurePosixPath(module).stem)


def in_shared_node_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the tests of each :data:`NODE_GROUPS` group's modules one after
    another, in its order, where the first of them was collected (a module's own order
    kept)."""
    for modules in NODE_GROUPS.values():
        items = _gathered(items, modules)
    return items


def with_long_units_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the tests of :data:`LONG_UNIT_MODULES` one after another, in its
    order, before the first other unit test (a module's own order kept)."""
    return _gathered(items, LONG_UNIT_MODULES, before=lambda module: module.startswith(UNIT_DIR))


def with_alone_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the tests marked ``alone`` at the end (each's order kept)."""
    alone = [item for item in items if item.get_closest_marker("alone") is not None]
    return [item for item in items if item not in alone] + alone


def _gathered(items: list[pytest.Item], modules: tuple[str, ...],
              before: Callable[[str], bool] | None = None) -> list[pytest.Item]:  # fmt: skip
    """``items`` with the tests of ``modules`` one after another in that order (a module's
    own order kept): before the first other test whose module ``before`` accepts, or
    (``before`` None, or none accepted) where the first of them was collected."""
    rank = {module: k for k, module in enumerate(modules)}
    gathered = [item for item in items if module_of(item.nodeid) in rank]
    if not gathered:
        return items
    rest = [item for item in items if module_of(item.nodeid) not in rank]
    at = items.index(gathered[0])  # none of them before it: its place in ``rest`` too
    if before is not None:
        at = next((k for k, item in enumerate(rest) if before(module_of(item.nodeid))), at)
    gathered.sort(key=lambda item: rank[module_of(item.nodeid)])  # stable
    return [*rest[:at], *gathered, *rest[at:]]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in its group (:func:`group_of`), the shared-node tests in their order,
    the long unit modules first among the unit tests, the tests marked ``alone`` last
    (every worker collects, and so reorders, the same way)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid)))
    items[:] = with_alone_last(with_long_units_first(in_shared_node_order(items)))


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with path.open("a") as file:  # closing it releases the lock
        fcntl.flock(file, mode)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run a test marked ``alone`` while no other worker runs one (a readers-writer lock
    over files every worker of the run shares): it closes the gate, then takes the lock
    exclusively; every other test passes the gate and shares the lock. Without workers
    there is nobody to wait for; without pytest's cache (``-p no:cacheprovider``) no
    folder the workers share."""
    if "PYTEST_XDIST_WORKER" not in os.environ or item.config.cache is None:
        return (yield)
    folder = item.config.cache.mkdir("aegaeon-alone")
    gate, lock = folder / "gate", folder / "lock"
    if item.get_closest_marker("alone") is not None:
        with _flock(gate, fcntl.LOCK_EX), _flock(lock, fcntl.LOCK_EX):
            return (yield)
    with _flock(gate, fcntl.LOCK_SH):
        pass
    with _flock(lock, fcntl.LOCK_SH):
        return (yield)
