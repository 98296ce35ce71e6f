"""`aegaeon bench ...`: one module per benchmark, each exposing ``register``.

Benchmark modules keep their top level light (no torch, transformers or vllm
imports): heavy imports happen inside the command function.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, str] = {
    "engine": "aegaeon_bench.engine.bench",
    "quant": "aegaeon_bench.engine.quant",
    "switch": "aegaeon_bench.switch.bench",
    "serve": "aegaeon_bench.serve.bench",
    "sweep": "aegaeon_bench.serve.sweep",
    "report": "aegaeon_bench.report.figures",
    "chaos": "aegaeon_bench.reliability.chaos",
    "overload": "aegaeon_bench.serve.overload",
    "cancel": "aegaeon_bench.reliability.cancel",
    "soak": "aegaeon_bench.reliability.soak",
    "fuzz": "aegaeon_bench.reliability.fuzz",
    "clients": "aegaeon_bench.serve.clients",
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
