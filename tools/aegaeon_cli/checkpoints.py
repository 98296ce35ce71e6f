"""What ``aegaeon serve`` says before it starts about models whose files changed.

A stat per file against the sizes ``market.json`` records (cheap, so every start
does it): a model with a missing or resized file is served as unavailable (its
requests answered 503 ``model_unavailable``) while every other model is served;
the cachemgr makes that decision (and checks the headers and, at a model's first
load, the digests); this only tells the operator at once, one line per model.
"""

from __future__ import annotations

from aegaeon_common.config import Config
from aegaeon_common.market_files import MarketRecords, size_problem

__all__ = ["unreadable_lines"]


def unreadable_lines(config: Config) -> list[str]:
    """One line per served model whose files are not the size the market records."""
    records = MarketRecords(config.market_dir)
    lines = []
    for model in config.models:
        problem = size_problem(model.path, records.files(model.path))
        if problem is not None:
            lines.append(f"model {model.name} will be unavailable: {problem} (the other models "
                         f"are served; restore the file, then POST "
                         f"/v1/aegaeon/models/{model.name}/reload)")
    return lines
