"""tests/worker_groups.py: which xdist worker runs which tests, checked on a real
two-worker run of a small tree laid out as the suite's (the suite's own addopts)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from worker_groups import (
    LONG_UNIT_MODULES,
    NODE_GROUPS,
    REAL_NODE_GROUP,
    REAL_NODE_MODULES,
    SHARED_NODE_GROUP,
    SHARED_NODE_MODULES,
    group_of,
    module_of,
    with_alone_last,
    with_long_units_first,
)

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
OTHER_MODULES = ("tests/e2e/test_alpha.py", "tests/integration/test_beta.py",
                 "tests/unit/test_gamma.py", "tests/unit/test_delta.py")  # fmt: skip
PER_MODULE = 3

TEST_BODY = '''
import os


def _note(name):
    with open(os.environ["RAN_LOG"], "a") as log:
        log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '-')} {__file__} {name}\\n")

'''


def test_groups_name_the_shared_node_or_the_module() -> None:
    assert {group_of(f"{m}::test_x[a::b]") for m in SHARED_NODE_MODULES} == {SHARED_NODE_GROUP}
    assert {group_of(f"{m}::test_x[a::b]") for m in REAL_NODE_MODULES} == {REAL_NODE_GROUP}
    assert group_of("tests/unit/test_gamma.py::Klass::test_x") == "test_gamma"
    assert module_of("tests/unit/test_gamma.py::test_x[1]") == "tests/unit/test_gamma.py"
    assert SHARED_NODE_MODULES[-1] == "tests/e2e/test_chaos.py"  # it kills every service


def test_the_long_unit_modules_go_first_among_the_unit_tests() -> None:
    assert all((REPO / m).is_file() for m in LONG_UNIT_MODULES)  # none renamed away
    before = ["tests/e2e/test_alpha.py::test_0", "tests/integration/test_beta.py::test_0",
              "tests/unit/test_aa.py::test_0"]  # fmt: skip
    longs = [f"{m}::test_{k}" for m in reversed(LONG_UNIT_MODULES) for k in (1, 0)]
    collected = [*before, *longs, "tests/unit/test_zz.py::test_0"]
    items = [cast(pytest.Item, SimpleNamespace(nodeid=n)) for n in collected]
    # in the tuple's order, each module's tests in their own (collected) order, before the
    # first other unit test
    assert [item.nodeid for item in with_long_units_first(items)] == [
        *before[:2], *(f"{m}::test_{k}" for m in LONG_UNIT_MODULES for k in (1, 0)),
        before[2], collected[-1]]  # fmt: skip


def test_the_tests_marked_alone_go_last() -> None:
    collected = ["tests/e2e/test_a.py::test_0", "tests/integration/test_alone.py::test_0",
                 "tests/unit/test_b.py::test_0", "tests/unit/test_alone2.py::test_0"]  # fmt: skip

    def item(nodeid: str) -> pytest.Item:
        marked = "alone" in nodeid
        return cast(pytest.Item, SimpleNamespace(
            nodeid=nodeid, get_closest_marker=lambda name: name if marked and name == "alone"
            else None))  # fmt: skip

    ordered = [i.nodeid for i in with_alone_last([item(n) for n in collected])]
    assert ordered == [collected[0], collected[2], collected[1], collected[3]]


def _suite_addopts() -> list[str]:
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return shlex.split(ini["addopts"])


def test_two_workers_keep_modules_whole_and_the_shared_node_modules_in_order(
    tmp_path: Path,
) -> None:
    addopts = _suite_addopts()
    assert "loadgroup" in addopts  # what scripts/test's `-n 2` runs with
    grouped = [m for modules in NODE_GROUPS.values() for m in modules]
    # a shuffled layout: the shared-node modules are collected in another order than theirs
    for module in (*grouped, *OTHER_MODULES):
        path = tmp_path / module
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(TEST_BODY + "".join(f"def test_{k}():\n    _note('{k}')\n\n\n"
                                            for k in range(PER_MODULE)))  # fmt: skip
    (tmp_path / "tests" / "conftest.py").write_text(
        "from worker_groups import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the root: node ids as the suite's
    log = tmp_path / "ran.log"
    env = {**os.environ, "RAN_LOG": str(log), "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", *addopts, "tests"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    runs = [line.split() for line in log.read_text().splitlines()]
    assert len(runs) == PER_MODULE * (len(grouped) + len(OTHER_MODULES))
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, path, _ in runs:
        workers[str(Path(path).relative_to(tmp_path))].add(worker)
    assert all(len(w) == 1 and "-" not in w for w in workers.values()), workers
    for modules in NODE_GROUPS.values():
        shared = [(Path(path).relative_to(tmp_path).as_posix(), int(k))
                  for worker, path, k in runs
                  if Path(path).relative_to(tmp_path).as_posix() in modules]  # fmt: skip
        # one worker, one module after another in the group's order (chaos last in the
        # shared node's), each module's tests in their own order
        assert len({next(iter(workers[m])) for m in modules}) == 1, modules
        assert shared == [(m, k) for m in modules for k in range(PER_MODULE)]


ALONE_BODY = '''
import os
import time

import pytest


def _note(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["RAN_LOG"], "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {name} {start} {time.monotonic()}\\n")

'''


def test_a_test_marked_alone_runs_while_the_other_worker_runs_none(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_alone.py").write_text(
        ALONE_BODY + "@pytest.mark.alone\ndef test_alone():\n    _note('alone', 1.0)\n")
    (tests / "test_busy.py").write_text(ALONE_BODY + "".join(
        f"def test_{k}():\n    _note('busy', 0.25)\n\n\n" for k in range(8)))
    (tests / "conftest.py").write_text(
        "from worker_groups import pytest_collection_modifyitems, pytest_runtest_protocol"
        "  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: alone\n")
    log = tmp_path / "ran.log"
    env = {**os.environ, "RAN_LOG": str(log), "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    argv = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "tests"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    runs = [(worker, name, float(start), float(end))
            for worker, name, start, end in map(str.split, log.read_text().splitlines())]
    alone = [run for run in runs if run[1] == "alone"]
    busy = [run for run in runs if run[1] == "busy"]
    assert len(alone) == 1 and len(busy) == 8
    assert {run[0] for run in busy} != {alone[0][0]}  # the other worker ran them
    _, _, start, end = alone[0]
    assert all(b_end <= start or b_start >= end for _, _, b_start, b_end in busy), runs
