"""``aegaeon market create``: the command-line face of `create_market`.

Registered by the ``aegaeon`` console script; imports nothing heavy at top
level (torch loads only when a market is actually built).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from aegaeon_market.ladder import PROFILES
from aegaeon_market.manifest import default_market_dir
from aegaeon_market.plan import MarketError

DTYPES = ("bfloat16", "float16", "float32")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``market`` (with its ``create`` subcommand) to the ``aegaeon`` parser."""
    market = subparsers.add_parser(
        "market", help="make a market of small seeded checkpoints",
        description="Markets of small Llama-family checkpoints with random, seeded weights.")
    sub = market.add_subparsers(dest="market_command", required=True, metavar="SUBCOMMAND")
    create = sub.add_parser(
        "create", help="write a market directory",
        description="Write N models in the Hugging Face layout plus market.json. "
                    "The same arguments always give byte-identical files.")
    create.add_argument("--out", type=Path, default=None,
                        help="market directory (default: $AEGAEON_MARKET or ./market)")
    create.add_argument("--models", type=_positive_int, default=8, metavar="N",
                        help="number of models; beyond the ladder it repeats with new seeds "
                             "(default: 8)")
    create.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    create.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="weight dtype (default: bfloat16)")
    create.add_argument("--profile", choices=tuple(PROFILES), default="default",
                        help="default: ~5M-100M ladder; small: its three smallest sizes")
    create.add_argument("--quiet", action="store_true", help="no progress bar")
    create.set_defaults(func=run_create)


def run_create(args: argparse.Namespace) -> int:
    """Build the market; errors go to stderr with exit code 2."""
    from aegaeon_market.create import create_market

    out: Path = args.out if args.out is not None else default_market_dir()
    start = time.perf_counter()
    try:
        entries = create_market(out, args.models, args.seed, args.dtype, args.profile,
                                progress=not args.quiet)
    except MarketError as exc:
        print(f"aegaeon market create: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = exc.filename or out
        print(f"aegaeon market create: error: cannot write {where}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    elapsed_s = time.perf_counter() - start
    total = sum(e.params for e in entries)
    print(f"wrote {len(entries)} models ({total / 1e6:.0f}M parameters, {args.dtype}) "
          f"to {out} in {elapsed_s:.1f} s")
    for entry in entries:
        role = f"  [{entry.role}]" if entry.role else ""
        print(f"  {entry.name:<16} {entry.arch:<20} {entry.params / 1e6:7.1f}M{role}")
    return 0
