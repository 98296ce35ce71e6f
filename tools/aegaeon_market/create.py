"""Build a market directory: plan the models, write each, write ``market.json`` last.

``market.json`` is written only after every model is complete, so its
presence means the market is whole; `ensure_market` relies on that.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from aegaeon_market.families import FAMILIES
from aegaeon_market.fingerprint import market_fingerprint
from aegaeon_market.manifest import (
    MANIFEST,
    Manifest,
    MarketEntry,
    default_market_dir,
    read_manifest,
)
from aegaeon_market.plan import MarketError, ModelPlan, plan_market
from aegaeon_market.writer import TORCH_DTYPES, tokenizer_json, write_model


def _clear_old_market(out: Path) -> None:
    """Make ``out`` ready to receive a market without touching anything else in it.

    A directory holding a previous market loses that market's models; any
    other non-empty directory is refused, so a typo in ``--out`` cannot
    overwrite someone's files.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise MarketError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not (out / MANIFEST).is_file():
        raise MarketError(f"{out} is not empty and holds no {MANIFEST}; choose another --out")
    old = read_manifest(out)
    (out / MANIFEST).unlink()
    for entry in old.entries:
        if entry.path.parent == out and entry.path.is_dir():
            shutil.rmtree(entry.path)


def _entry(plan: ModelPlan, out: Path, dtype: str) -> MarketEntry:
    arch = FAMILIES[plan.recipe.family].architecture
    return MarketEntry(plan.name, out / plan.name, arch, plan.params, dtype, plan.role)


def create_market(
    out: Path | str,
    num_models: int = 8,
    seed: int = 0,
    dtype: str = "bfloat16",
    profile: str = "default",
    progress: bool = True,
) -> list[MarketEntry]:
    """Write a market of ``num_models`` seeded checkpoints into ``out``.

    The same arguments always give byte-identical files. ``profile`` is
    ``default`` (the 8-rung ladder, ~5M to ~100M parameters) or ``small`` (its
    three smallest rungs). Raises `MarketError` for bad arguments or an ``out``
    that is not empty and not a market, `OSError` when writing fails.
    """
    if dtype not in TORCH_DTYPES:
        raise MarketError(f"unknown dtype {dtype!r}; choose from {', '.join(TORCH_DTYPES)}")
    plans = plan_market(num_models, seed, profile)
    root = Path(out).resolve()
    _clear_old_market(root)
    root.mkdir(parents=True, exist_ok=True)
    families = sorted({p.recipe.family for p in plans})
    entries = []
    with tqdm(total=len(families) + len(plans), desc="market", unit="step",
              file=sys.stderr, disable=not progress) as bar:
        for key in families:
            # tokenizers first: training dominates the first models' time otherwise
            bar.set_postfix_str(f"tokenizer {key}")
            tokenizer_json(key)
            bar.update()
        for plan in plans:
            bar.set_postfix_str(plan.name)
            write_model(plan, root / plan.name, dtype)
            entries.append(_entry(plan, root, dtype))
            bar.update()
    manifest = Manifest(seed, profile, market_fingerprint(), tuple(entries))
    (root / MANIFEST).write_text(manifest.to_json(root), encoding="utf-8")
    return entries


def _current(root: Path) -> Manifest | None:
    """The market in ``root`` if it was written by this code, else None."""
    if not (root / MANIFEST).is_file():
        return None
    manifest = read_manifest(root)
    return manifest if manifest.generator == market_fingerprint() else None


def _build_into_place(root: Path, num_models: int, seed: int, dtype: str, profile: str,
                      progress: bool) -> list[MarketEntry]:
    """Build aside, then swap into ``root``; whoever finishes first wins a race."""
    tag = f"{root.name}.{os.getpid()}"
    tmp, trash = root.parent / f".{tag}.tmp", root.parent / f".{tag}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    create_market(tmp, num_models, seed, dtype, profile, progress)
    try:
        if _current(root) is None:
            if (root / MANIFEST).is_file():
                # a stale market: out of the way first (unless a racer just moved it)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(root, trash)
            os.rename(tmp, root)  # atomic; replaces an empty directory
    except OSError:
        if _current(root) is None:  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
    return list(read_manifest(root).entries)


def ensure_market(
    market_dir: Path | str | None = None,
    num_models: int = 8,
    seed: int = 0,
    dtype: str = "bfloat16",
    profile: str = "default",
    progress: bool = True,
) -> list[MarketEntry]:
    """The market in ``market_dir`` (default `default_market_dir`), built if missing.

    An existing market written by this version of the market code is returned
    as it is, whatever arguments it was made with (so a user's 16-model market
    stays theirs). One written by other market code is rebuilt with the seed,
    size, profile and dtype it records. Safe when several processes ask at
    once: markets are built in a private sibling directory and renamed into
    place. A non-empty directory without ``market.json`` is a `MarketError`.
    """
    root = Path(market_dir if market_dir is not None else default_market_dir()).resolve()
    current = _current(root)
    if current is not None:
        return list(current.entries)
    if (root / MANIFEST).is_file():
        old = read_manifest(root)
        if old.entries:
            num_models, seed, profile = len(old.entries), old.seed, old.profile
            dtype = old.entries[0].dtype
    elif root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise MarketError(f"{root} exists but holds no {MANIFEST}; remove it or choose another "
                          "directory")
    return _build_into_place(root, num_models, seed, dtype, profile, progress)
