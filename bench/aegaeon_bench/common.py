"""What every bench command shares: its parser, the machine record (in every bench's JSON,
so numbers from different CPUs or kernel levels are never confused), the arguments of a
bench that starts its own node, and the report's way out (``--out`` and ``--json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from aegaeon_common.market_index import MARKET_DIR_HELP


def machine_info(isa: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """``cpu_model``, ``isa`` (the native kernels' level in use: ``isa`` when the bench
    ran an engine, else the level an engine here would pick; ``torch`` for the torch
    path), ``threads`` (torch threads per engine; None where the bench cannot know,
    e.g. a server's) and ``torch`` (its version)."""
    import torch
    from aegaeon_engine.isa import cpu_model
    from aegaeon_engine.native import expected_isa

    return {
        "cpu_model": cpu_model(),
        "isa": isa or expected_isa() or "torch",
        "threads": threads,
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
    }


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
              help_line: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``aegaeon bench NAME``: its line in the list and, as its
    description, the module's docstring kept as written."""
    return sub.add_parser(name, help=help_line, description=doc,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """``--market`` and ``--config`` of a bench that starts its own node."""
    parser.add_argument("--market", type=Path, help=MARKET_DIR_HELP)
    parser.add_argument("--config", type=Path, help="deployment YAML (default: embedded)")


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """``--api-key``: what a bench sends a node that has API keys (its own node's
    ``--config`` may set ``proxy.api_keys`` too)."""
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="the node's API key, sent as Authorization: Bearer KEY "
                             "(default: $AEGAEON_API_KEY)")  # fmt: skip


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$AEGAEON_API_KEY``, else None."""
    from aegaeon_common.env import read_env

    given: str | None = getattr(args, "api_key", None)
    return given or read_env().api_key


def key_env(key: str | None) -> dict[str, str]:
    """The environment of a child command (a bench that runs ``bench serve``): this
    process's, with ``key`` as ``$AEGAEON_API_KEY``, so it never shows on a command line."""
    import os

    from aegaeon_common.env import API_KEY_ENV

    env = dict(os.environ)
    if key:
        env[API_KEY_ENV] = key
    return env


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments a report records: every one but the handler and the API key."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}


def add_slo_arguments(parser: argparse.ArgumentParser, ttft_s: float, tbt_s: float,
                      source: str = "") -> None:  # fmt: skip
    """``--ttft`` and ``--tbt``: the SLO a run is scored by (``source``: where the
    defaults come from, for the help)."""
    note = f"{source}: " if source else ""
    parser.add_argument("--ttft", type=float, default=ttft_s,
                        help=f"TTFT target, s ({note}{ttft_s:g})")  # fmt: skip
    parser.add_argument("--tbt", type=float, default=tbt_s,
                        help=f"TBT target, s ({note}{tbt_s:g})")  # fmt: skip


def add_own_node_arguments(parser: argparse.ArgumentParser) -> None:
    """What a bench that starts its own node and reports in JSON takes: the node's
    arguments, ``--api-key``, and ``--out`` and ``--json`` (where the report goes)."""
    add_node_arguments(parser)
    add_api_key_argument(parser)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--json", action="store_true", help="last stdout line: the report")


def node_market(args: argparse.Namespace) -> Path:
    """``--market`` (default: $AEGAEON_MARKET or ./market), resolved; built with the real
    models when it has no index and no ``--config`` names the models instead. What
    `aegaeon serve` would refuse of them (a ``--config`` that cannot be read or does not validate, a
    device this machine lacks) is a ConfigError or EnvError first: one line, before
    anything is built or started."""
    from aegaeon_cli.serve import check_serve
    from aegaeon_common.config import read_config_file
    from aegaeon_common.market_index import MANIFEST
    from aegaeon_market import default_market_dir, ensure_market

    if args.config is not None:
        read_config_file(args.config)
    market: Path = (args.market or default_market_dir()).resolve()
    if args.config is None and not (market / MANIFEST).exists():
        ensure_market(market, real_models=True)
    check_serve(market, args.config)
    return market


def emit_report(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """The report to ``--out`` (atomically) and, with ``--json``, as the last stdout line;
    the exit code (0 when ``report["ok"]``)."""
    from aegaeon_common.kept import write_atomic

    if args.out is not None:
        write_atomic(args.out, json.dumps(report, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if report["ok"] else 1
