"""The `aegaeon` console script.

Each subcommand lives in its own room and is imported only when used, so
`aegaeon market create` never pays for importing the proxy (or torch for the
simulator). A room exposes ``register(subparsers)`` which adds its parser and
sets ``func`` (``Callable[[argparse.Namespace], int]``) as a default.

Mistakes are answered before anything starts, each in one line on stderr with
exit code 2: the environment (``AEGAEON_*``, read and checked first), the
command line (:class:`~aegaeon_common.usage.OneLineParser`), and a config file
or setting a command refuses (a ``ConfigError`` or ``EnvError`` it raises).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import cast

from aegaeon_common.config_parse import ConfigError
from aegaeon_common.env import EnvError, read_env
from aegaeon_common.usage import OneLineParser, fail

# subcommand -> (module with register(), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "market": ("aegaeon_market.cli", "make a market, import HF or GGUF checkpoints into it"),
    "generate": ("aegaeon_engine.cli", "generate text with the engine alone (no services)"),
    "bench": ("aegaeon_bench.cli", "benchmarks: engine, switch, serve, sweep, report"),
    "sim": ("aegaeon_sim.cli", "discrete-event simulation of the paper's cluster"),
    "serve": ("aegaeon_cli.serve", "start every service on this machine"),
    "node": ("aegaeon_cli.node_main", "run one node's cachemgr and instances (many nodes)"),
    "plan": ("aegaeon_cli.plan", "how --gpus places and sizes this machine's instances"),
    "proxy": ("aegaeon_proxy.main", "run the OpenAI-compatible proxy"),
    "prefill": ("aegaeon_prefill.main", "run one prefill instance"),
    "decode": ("aegaeon_decode.main", "run one decode instance"),
    "cachemgr": ("aegaeon_cachemgr.main", "run the node's cache manager"),
    "keys": ("aegaeon_cli.keys", "make the node's CURVE certificate (tcp:// sockets)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="aegaeon",
        description="Aegaeon: token-level multi-model LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        if name == wanted:
            module = importlib.import_module(module_name)
            module.register(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        read_env()  # every AEGAEON_* variable checked before any command runs
    except EnvError as exc:
        return fail("aegaeon", exc)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"unknown command {args.command!r}")
    try:
        return cast(Callable[[argparse.Namespace], int], func)(args)
    except (ConfigError, EnvError) as exc:
        return fail(_prog(args), exc)


def _prog(args: argparse.Namespace) -> str:
    """``aegaeon COMMAND [SUBCOMMAND]`` of a parsed command line (the line's prefix)."""
    words = [args.command]
    for key in ("market_command", "bench", "kind"):
        value = getattr(args, key, None)
        if isinstance(value, str):
            words.append(value)
            break
    return " ".join(["aegaeon", *words])


if __name__ == "__main__":
    sys.exit(main())
