"""aegaeon_market: a market of small seeded checkpoints in the Hugging Face layout.

`create_market` writes one (``aegaeon market create`` on the command line),
`load_market` reads its ``market.json``, `ensure_market` builds it only when
missing. Models are Llama, Mistral, Qwen2 and Qwen3 variants from ~5M to
~100M parameters, with byte-level BPE tokenizers trained on a shipped corpus.

Importing this package is cheap; torch and tokenizers load on first use of
`create_market` / `ensure_market`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aegaeon_common.market_index import MarketEntry, MarketError, default_market_dir, load_market

from aegaeon_market.manifest import default_bench_model

if TYPE_CHECKING:
    from aegaeon_market.create import create_market, ensure_market

__all__ = [
    "MarketEntry",
    "MarketError",
    "corpus_path",
    "create_market",
    "default_bench_model",
    "default_market_dir",
    "ensure_market",
    "load_market",
]

_LAZY = {"create_market", "ensure_market"}


def __getattr__(name: str) -> Any:
    # create pulls in torch; keep `import aegaeon_market` light for the CLI table
    if name in _LAZY:
        from aegaeon_market import create

        return getattr(create, name)
    raise AttributeError(f"module 'aegaeon_market' has no attribute {name!r}")


def corpus_path() -> Path:
    """Path of the shipped English corpus (handy for prompt generators)."""
    return Path(__file__).parent / "corpus" / "corpus.txt"
