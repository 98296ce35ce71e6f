"""`aegaeon bench ...`: one module per benchmark, each exposing ``register``.

Benchmark modules keep their top level light (no torch, transformers or vllm
imports): heavy imports happen inside the command function.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, str] = {
    "engine": "aegaeon_bench.engine_bench",
    "switch": "aegaeon_bench.switch_bench",
    "serve": "aegaeon_bench.serve_bench",
    "sweep": "aegaeon_bench.sweep",
    "report": "aegaeon_bench.report",
    "chaos": "aegaeon_bench.chaos",
    "overload": "aegaeon_bench.overload",
    "cancel": "aegaeon_bench.cancel",
    "soak": "aegaeon_bench.soak",
    "fuzz": "aegaeon_bench.fuzz",
    "clients": "aegaeon_bench.clients",
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="benchmarks (engine, switch, serve, sweep, chaos, ...)")
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module_name in BENCHES.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not built yet
        module.register(benches)
