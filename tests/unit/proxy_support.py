"""Shared helper of the proxy unit tests: a small market of real checkpoints."""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path


@cache
def market_dir() -> Path:
    """The market's ``small`` profile (Llama-3, Mistral, Qwen2 tokenizers), built once per machine.

    ``ensure_market`` reuses an existing identical market and is safe when
    several test processes ask at once.
    """
    from aegaeon_market import ensure_market

    root = Path(tempfile.gettempdir()) / f"aegaeon-proxy-test-market-{os.getuid()}"
    ensure_market(root, num_models=4, seed=0, profile="small", progress=False)
    return root
