"""Fixtures shared by the unit tests (helpers live in the ``*_support`` modules)."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxy_support import market_dir


@pytest.fixture(scope="session")
def proxy_market() -> Path:
    """The proxy tests' small market of real checkpoints (see ``proxy_support.market_dir``)."""
    return market_dir()
