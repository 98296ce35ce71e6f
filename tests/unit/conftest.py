"""Fixtures shared by the unit tests (helpers live in the ``*_support`` modules)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from gpumem_support import PREFIX, TAG
from proxy_support import MODEL, Client, ScriptedBackend, front, market_dir, scripted_config

if TYPE_CHECKING:
    from aegaeon_gpumem import EventTable

# Without a GPU, the Triton kernels' tests (test_triton_kernels.py) run them in Triton's
# interpreter on the CPU. Triton reads this when a kernel is defined, so before any test
# imports aegaeon_engine.gpu; nothing else here runs Triton (the CPU engine keeps its own
# kernels). With a GPU the CUDA engine's tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def proxy_market() -> Path:
    """The proxy tests' small market of real checkpoints (see ``proxy_support.market_dir``)."""
    return market_dir()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "proxy(**fields): the ProxyConfig fields of the scripted proxy (`client`)")


@pytest.fixture
def backend() -> ScriptedBackend:
    """The scripted proxy's backend (a module may give another: a fixture of this name)."""
    return ScriptedBackend()


@pytest.fixture
def proxy_config(proxy_market: Path, request: pytest.FixtureRequest) -> Any:
    """The scripted proxy's config: :data:`proxy_support.MODEL`, and the ProxyConfig fields
    of the test's ``@pytest.mark.proxy(...)``."""
    marker = request.node.get_closest_marker("proxy")
    return scripted_config(proxy_market, **(marker.kwargs if marker else {}))


@pytest.fixture
async def client(proxy_config: Any, backend: ScriptedBackend) -> AsyncIterator[Client]:
    """A client of the HTTP front of `proxy_config` over `backend`."""
    async with front(proxy_config, backend) as c:
        yield c


@pytest.fixture
async def tok(client: Client) -> Any:
    """The tokenizer of :data:`proxy_support.MODEL`, as the front of `client` holds it."""
    from aegaeon_proxy.state import STATE

    return await client.app[STATE].assets.get(MODEL)


@pytest.fixture
def no_leaked_segments() -> Iterator[None]:
    """Fails the test that leaves a shared-memory segment of this process behind
    (the gpumem modules use it for every test: ``pytest.mark.usefixtures``)."""
    from aegaeon_gpumem import list_segments

    yield
    assert list_segments(PREFIX) == []


@pytest.fixture
def table() -> Iterator[EventTable]:
    """A 4-slot event table in shared memory, closed after the test."""
    from aegaeon_gpumem import EventTable, unique_name

    with EventTable.create(unique_name(TAG), 4) as t:
        yield t
