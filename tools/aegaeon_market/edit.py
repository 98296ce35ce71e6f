"""Change a market in place: import a model or write a preset's (``add``), ``remove`` one,
``list`` them.

Every change leaves the market whole or as it was. An import is checked and
converted (a preset written) into a private folder inside the market (same
file system), then, under the market's lock, moved into place by rename and
committed by the atomic rewrite of ``market.json``; a failure before that
commit undoes the renames, and the private folder is removed whatever
happens. A removal
commits ``market.json`` first and deletes the files after.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from aegaeon_common.market_files import record_files
from aegaeon_common.market_index import (
    MANIFEST,
    InMemory,
    Manifest,
    MarketEntry,
    MarketError,
    read_manifest,
)
from aegaeon_common.owner import stamp
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.loader import checkpoint_index
from aegaeon_engine.spec import FP8, ModelSpec
from tqdm import tqdm

from aegaeon_market.manifest import write_manifest
from aegaeon_market.preset_writer import MAX_SHARD_BYTES, write_preset, write_recipe
from aegaeon_market.presets import PRESET_DTYPE, Preset
from aegaeon_market.shapes import tensor_shapes

DTYPES = ("bfloat16", "float16", "float32", "fp8", FP8)  # fp8: FP8 projections (fp8_out)
GGUF_DEFAULT_DTYPE = "bfloat16"  # the market's own models are bfloat16 too
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class Listed:
    """One model of `list_models`: its entry and the bytes its files take."""

    entry: MarketEntry
    nbytes: int


@contextlib.contextmanager
def market_lock(root: Path) -> Iterator[None]:
    """Serialise changes to the market in ``root`` (an flock on the folder itself, so no
    lock file is left beside or inside it)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _manifest_or_new(root: Path, staging: Path | None = None) -> Manifest:
    """The market in ``root``; an empty one if ``root`` is missing or an empty folder
    (but for our own ``staging`` folder)."""
    if (root / MANIFEST).is_file():
        return read_manifest(root)
    if root.exists() and (not root.is_dir() or any(p != staging for p in root.iterdir())):
        raise MarketError(f"{root}: not a market (no {MANIFEST}) and not empty")
    return Manifest(seed=0, profile="", generator="", entries=())


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise MarketError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 64, "
                          "starting with a letter or digit)")


def _kind(source: Path) -> str:
    """``gguf`` or ``hf``; `CheckpointError` for anything else."""
    if source.is_dir():
        return "hf"
    if source.suffix.lower() == ".gguf" or source.is_file():
        return "gguf"
    raise CheckpointError(source, None, "missing (expected a Hugging Face checkpoint directory "
                                        "or a .gguf file)")


def _refuse_if_adapted(manifest: Manifest, root: Path, name: str, what: str) -> None:
    """A model that LoRA adapters of the market adapt is neither removed nor replaced."""
    adapters = [e.name for e in manifest.entries if e.base == name]
    if adapters:
        raise MarketError(f"{root / MANIFEST}: models: cannot {what} {name!r}: the adapters "
                          f"{', '.join(adapters)} are of it (remove them first)")


def _check_clash(manifest: Manifest, root: Path, name: str, replace_existing: bool) -> None:
    names = {e.name for e in manifest.entries}
    if name in names and not replace_existing:
        raise MarketError(f"{root / MANIFEST}: models: a model named {name!r} exists "
                          "(pass --replace to overwrite it)")
    if name in names:
        _refuse_if_adapted(manifest, root, name, "replace")
    if name not in names and (root / name).exists():
        raise MarketError(f"{root / name}: exists and is not a model of this market; "
                          "choose another --name")


def add_model(market_dir: Path | str, source: Path | str, name: str, dtype: str | None = None,
              *, replace_existing: bool = False, progress: bool = True) -> MarketEntry:
    """Import ``source`` (HF directory or ``.gguf`` file) into the market as ``name``.

    ``dtype`` defaults to the checkpoint's own (HF) or, for GGUF, its Q8_0/Q4_0/Q4_1
    matrices kept quantized (the rest bfloat16); a dtype given dequantizes everything.
    Raises `CheckpointError` for a defective source and `MarketError` for a
    name clash or a broken market; either way the market is unchanged.
    """
    root, src = Path(market_dir).resolve(), Path(source).resolve()
    dtype = _check_request(root, name, dtype, replace_existing)
    # a missing source is refused before anything is made
    if _kind(src) == "gguf" and dtype == FP8:
        raise MarketError(f"--dtype fp8: {src} is a GGUF file; FP8 is made from a Hugging "
                          "Face checkpoint or a preset (GGUF keeps its own quantization)")

    def write(staging: Path) -> MarketEntry:
        return replace(convert_source(src, staging, name, dtype, progress), source=str(src))

    return _stage_and_commit(root, name, replace_existing, write)


def add_random(market_dir: Path | str, preset: Preset, name: str, dtype: str | None = None,
               *, replace_existing: bool = False, progress: bool = True,
               max_shard_bytes: int = MAX_SHARD_BYTES, in_memory: bool = False,
               seed: int | None = None) -> MarketEntry:
    """Write a random-weight model of ``preset`` (a real model's config) into the market as
    ``name``, in ``dtype`` (default bfloat16), through the same staging and commit as an
    import: on any error the market is unchanged. ``max_shard_bytes`` overrides the
    safetensors shard size (tests).

    ``in_memory``: no weight file is written; the entry records the preset, dtype and
    ``seed`` (default: one more than any in-memory entry of the market has) and the Model
    Cache generates its weights at load (``aegaeon_engine.random_weights``). Every
    in-memory entry has its own seed: a ``seed`` another entry has is refused."""
    root = Path(market_dir).resolve()
    serve_dtype = _check_request(root, name, dtype, replace_existing) or PRESET_DTYPE
    if in_memory:
        return _add_in_memory(root, preset, name, serve_dtype, replace_existing, seed)
    if seed is not None:
        raise MarketError("--seed: only an --in-memory entry takes a seed (written presets are "
                          "seed 0)")

    def write(staging: Path) -> MarketEntry:
        count = len(tensor_shapes(preset.recipe))
        with _bar(count, f"write {preset.name}", progress) as step:
            write_preset(preset, staging, serve_dtype, step, max_shard_bytes)
        _check_written(staging, preset.architecture)
        return MarketEntry(name, staging, preset.architecture, preset.params, serve_dtype,
                           source=preset.source)

    return _stage_and_commit(root, name, replace_existing, write)


def _seed_owner(manifest: Manifest, seed: int, name: str) -> str | None:
    """The other in-memory entry with ``seed`` (None: it is free for ``name``)."""
    return next((e.name for e in manifest.entries if e.in_memory is not None
                 and e.in_memory.seed == seed and e.name != name), None)  # fmt: skip


def next_seed(manifest: Manifest) -> int:
    """A seed no in-memory entry of the market has (1 and up; written presets are 0)."""
    return 1 + max((e.in_memory.seed for e in manifest.entries if e.in_memory is not None),
                   default=0)  # fmt: skip


def _add_in_memory(root: Path, preset: Preset, name: str, dtype: str, replace_existing: bool,
                   seed: int | None) -> MarketEntry:
    """``add_random`` of an in-memory entry: the seed is chosen, or checked, under the
    market's lock, where the entry is committed."""
    if seed is not None and seed < 0:
        raise MarketError(f"--seed {seed}: must be a whole number >= 0")
    with _staging(root, name) as staging, market_lock(root):
        manifest = _manifest_or_new(root, staging)
        _check_clash(manifest, root, name, replace_existing)
        chosen = next_seed(manifest) if seed is None else seed
        owner = _seed_owner(manifest, chosen, name)
        if owner is not None:
            raise MarketError(f"--seed {chosen}: model {owner!r} has it (every in-memory "
                              "entry has its own seed, so no two share weights)")
        write_recipe(preset, staging, dtype, chosen)
        ModelSpec.from_dir(staging)  # what the engine will read
        # its files (config, tokenizer, the recipe) with their digests, as any entry's
        entry = MarketEntry(name, root / name, preset.architecture, preset.params, dtype,
                            source=preset.source, files=record_files(staging),
                            in_memory=InMemory(preset.name, chosen))
        _commit(root, manifest, entry, staging)
    return entry


def _check_request(root: Path, name: str, dtype: str | None,
                   replace_existing: bool) -> str | None:
    """Refuse a bad name or dtype, or a clash, before anything is written; the dtype
    (``fp8`` as ``float8_e4m3fn``)."""
    check_name(name)
    if dtype is not None and dtype not in DTYPES:
        raise MarketError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    _check_clash(_manifest_or_new(root), root, name, replace_existing)
    return FP8 if dtype == "fp8" else dtype


def _stage_and_commit(root: Path, name: str, replace_existing: bool,
                      write: Callable[[Path], MarketEntry]) -> MarketEntry:
    """``write`` the model into a private folder of the market, then move it into place
    and list it under the lock; on any error nothing of it stays."""
    with _staging(root, name) as staging:
        # each file's size and digest as written: `market verify` and the cachemgr
        # check them against what is on disk later
        entry = replace(write(staging), path=root / name, files=record_files(staging))
        with market_lock(root):
            manifest = _manifest_or_new(root, staging)
            _check_clash(manifest, root, name, replace_existing)
            _commit(root, manifest, entry, staging)
    return entry


@contextlib.contextmanager
def _staging(root: Path, name: str) -> Iterator[Path]:
    """A private folder of the market in ``root`` (made if missing) to write ``name`` into,
    removed when done (committed, it was renamed away); a market this call began is
    removed too when nothing was committed to it."""
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".add-{name}.{stamp()}.tmp"  # whose, for `market gc` (leftovers.py)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created:  # empty unless something was committed to it
            with contextlib.suppress(OSError):
                root.rmdir()


def convert_source(src: Path, staging: Path, name: str, dtype: str | None,
                   progress: bool, quantized: bool | None = None) -> MarketEntry:
    """Check ``src`` (HF directory or GGUF file) and write it into ``staging``; its entry.
    ``quantized`` (GGUF): keep its Q8_0/Q4_0/Q4_1 matrices, the rest in ``dtype``
    (default: when no dtype is given)."""
    kind = _kind(src)
    if kind == "gguf":
        from aegaeon_market.gguf_import import convert_gguf, kept_quantization, read_gguf

        gguf_model = read_gguf(src)
        # no dtype asked for: Q8_0/Q4_0/Q4_1 matrices stay quantized, the rest bfloat16
        keep = dtype is None if quantized is None else quantized
        quant = kept_quantization(gguf_model) if keep else None
        serve_dtype = dtype or GGUF_DEFAULT_DTYPE
        spec, params, count = gguf_model.spec, gguf_model.params, len(gguf_model.sources)
        with _bar(count, f"convert {src.name}", progress) as step:
            convert_gguf(gguf_model, staging, serve_dtype, step, quant)
        if quant is not None:
            serve_dtype = quant.linear  # what market.json and `market list` show
    else:
        from aegaeon_market.hf_import import convert_hf, read_hf_dir

        hf_model = read_hf_dir(src)
        serve_dtype = dtype or hf_model.spec.weight_dtype  # an FP8 source stays FP8
        spec, params, count = hf_model.spec, hf_model.params, len(hf_model.tensors)
        with _bar(count, f"import {src.name}", progress) as step:
            convert_hf(hf_model, staging, serve_dtype, step)
    _check_written(staging, spec.architecture)
    return MarketEntry(name, staging, spec.architecture, params, serve_dtype)


def _check_written(staging: Path, architecture: str) -> None:
    """What the engine will read: the written directory must parse and index cleanly."""
    written = ModelSpec.from_dir(staging)
    checkpoint_index(staging)
    if written.architecture != architecture:
        raise CheckpointError(staging / "config.json", "architectures",
                              f"{written.architecture} written for {architecture}")


@contextlib.contextmanager
def _bar(total: int, label: str, progress: bool) -> Iterator[Callable[[int], None]]:
    with tqdm(total=total, desc=label, unit="tensor", file=sys.stderr, mininterval=0.5,
              disable=not progress) as bar:

        def step(count: int) -> None:
            bar.update(count)

        yield step


def _commit(root: Path, manifest: Manifest, entry: MarketEntry, staging: Path) -> None:
    """Move ``staging`` to ``entry.path`` and rewrite ``market.json``; undo on failure."""
    final = entry.path
    old = root / f".old-{entry.name}.{stamp()}"
    replacing = final.exists()
    if replacing:
        os.rename(final, old)
    try:
        os.rename(staging, final)
        try:
            kept = [e for e in manifest.entries if e.name != entry.name]
            at = next((i for i, e in enumerate(manifest.entries) if e.name == entry.name),
                      len(kept))
            role = next((e.role for e in manifest.entries if e.name == entry.name), "")
            kept.insert(at, replace(entry, role=role))
            write_manifest(root, replace(manifest, entries=tuple(kept)))
        except BaseException:
            os.rename(final, staging)
            raise
    except BaseException:
        if replacing:
            os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_model(market_dir: Path | str, name: str) -> MarketEntry:
    """Remove ``name`` from the market (its entry, then its files)."""
    root = Path(market_dir).resolve()
    read_manifest(root)  # a missing or broken market is refused before the lock
    with market_lock(root):
        manifest = read_manifest(root)
        entry = next((e for e in manifest.entries if e.name == name), None)
        if entry is None:
            known = ", ".join(e.name for e in manifest.entries) or "none"
            raise MarketError(f"{root / MANIFEST}: models: no model named {name!r} "
                              f"(the market has: {known})")
        _refuse_if_adapted(manifest, root, name, "remove")
        kept = tuple(e for e in manifest.entries if e.name != name)
        write_manifest(root, replace(manifest, entries=kept))
        # out of the way under the lock: a removal cut short leaves a stamped leftover
        # (`market gc` removes it), never a folder of the model's name
        doomed = root / f".removed-{name}.{stamp()}"
        if entry.path.parent == root and entry.path.is_dir():
            os.rename(entry.path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return entry


def list_models(market_dir: Path | str) -> list[Listed]:
    """The market's models and the bytes each one's files take on disk."""
    root = Path(market_dir).resolve()
    out = []
    for entry in read_manifest(root).entries:
        files = entry.path.rglob("*") if entry.path.is_dir() else iter(())
        out.append(Listed(entry, sum(p.stat().st_size for p in files if p.is_file())))
    return out
