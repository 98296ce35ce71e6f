"""End-to-end fixtures: one `aegaeon serve` per module over a small market."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_harness import Served, serving

E2E_MODELS = 4  # the "small" profile cycles its 3 smallest rungs: 3 families, 4 models


@pytest.fixture(scope="session")
def small_market() -> Path:
    from aegaeon_market import ensure_market

    root = Path(os.environ.get("AEGAEON_TEST_CACHE", tempfile.gettempdir()))
    market = root / f"aegaeon-e2e-market-{os.getuid()}-small{E2E_MODELS}"
    ensure_market(market, num_models=E2E_MODELS, profile="small", progress=False)
    return market


@pytest.fixture(scope="module")
def served(small_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(small_market, tmp_path_factory.mktemp("serve") / "run") as served:
        yield served
