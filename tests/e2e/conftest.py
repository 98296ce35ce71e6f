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
def _one_torch_thread() -> Iterator[None]:
    """torch on one thread in the tests' own process, as the module found it afterwards: the
    references (transformers, PEFT, the engine in process) step a small model token by
    token, and on a machine busy with the served node's processes (and another xdist
    worker) a second thread only waits on the first (transformers' greedy 32 tokens of
    SmolLM2: 14 s on two threads, 4 s on one, on the 2-core CI machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
