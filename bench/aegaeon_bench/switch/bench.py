"""``aegaeon bench switch``: what a model switch costs us, against the naive paths.

One run, every market model (or ``--models``). A real cachemgr process in a
temporary run directory holds the warm Model Cache and the unified CPU KV
cache; a decode worker built by ``build_worker`` from a Config does the
switching, this thread being its compute thread. Measured, in this order:

1. the unified KV cache's fragmentation under a mixed-model alloc/free
   workload through the cachemgr (``switch_kvfrag``);
2. per model, the scale-up from the Model Cache against a plain memcpy of
   the same bytes, interleaved (``switch_scaleup``);
3. per model B (A = the model before it), a full preemptive switch: swap-out
   of A's decode batch, scale-up of B, swap-in of B's batch, with prefetch
   off and on, alternating (``switch_preempt``);
4. sanity: exact bytes and greedy tokens equal to a fresh engine after
   A -> B -> A (``switch_check``);
5. the naive paths, after the worker is gone: a cold worker process to first
   token, a vLLM engine start (``--vllm-python``), transformers
   ``from_pretrained`` (``switch_naive``).

Prints tables; with ``--json`` the last stdout line is the summary object
(keys in ``switch_report``). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aegaeon_common.market_index import MARKET_DIR_HELP

from aegaeon_bench import common

Log = Callable[[str], None]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``switch`` benchmark parser."""
    parser = common.add_bench(
        sub, "switch", "model switch cost vs memcpy and naive restarts", __doc__)
    parser.add_argument("--market", type=Path, help=MARKET_DIR_HELP)
    parser.add_argument("--models", help="comma-separated subset of the market's models")
    parser.add_argument("--dtype", default="bfloat16", help="serving dtype")
    parser.add_argument("--repeats", type=int, default=7, help="scale-up/memcpy rounds")
    parser.add_argument("--switch-repeats", type=int, default=3,
                        help="preemptive switches per model, each with prefetch off and on")
    parser.add_argument("--batch", type=int, default=8, help="requests per decode batch")
    parser.add_argument("--context", type=int, default=256, help="tokens of KV per request")
    parser.add_argument("--slice-ms", type=float, default=250.0,
                        help="A's decode slice before the switch (the prefetch window)")
    parser.add_argument("--kv-ops", type=int, default=2000, help="ops of the KV workload")
    parser.add_argument("--cold-repeats", type=int, default=3, help="cold workers per model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--device", default="cpu",
                        help="the worker's device: cpu (default) or cuda[:N]; on CUDA the "
                        "memcpy baseline is a pinned host -> device copy")
    parser.add_argument("--vllm-python", help="interpreter with vllm installed "
                        "(default: /tmp/vllm-venv/bin/python if it exists)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold workers")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def _models(args: argparse.Namespace) -> dict[str, Path]:
    from aegaeon_market import default_market_dir, ensure_market, load_market

    market = Path(args.market) if args.market else default_market_dir()
    if not (market / "market.json").is_file():
        # the default market as `aegaeon serve` builds it, once
        ensure_market(market, progress=False, real_models=True)
    models = {e.name: Path(e.path) for e in load_market(market)}
    if args.models:
        wanted = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in models]
        if unknown:
            raise ValueError(f"not in the market: {', '.join(unknown)}")
        models = {n: models[n] for n in wanted}
    if len(models) < 2:
        raise ValueError("the switch bench needs at least two models")
    return models


def measure_worker(models: dict[str, Path], args: argparse.Namespace,
                   log: Log | None = None) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Steps 1-4 of the module docstring: per-model rows and run-wide figures."""
    from aegaeon_engine import ModelSpec, weight_layout

    from aegaeon_bench.switch.check import check_switches
    from aegaeon_bench.switch.kvfrag import run_kv_workload
    from aegaeon_bench.switch.preempt import measure_switches
    from aegaeon_bench.switch.rig import rig_sizes, switch_rig
    from aegaeon_bench.switch.scaleup import (
        PlainCopy,
        measure_scale_ups,
        plain_kind,
        scale_up_rows,
    )

    say = log or (lambda _msg: None)
    names = list(models)
    weight_bytes = [weight_layout(ModelSpec.from_dir(p), args.dtype).total_bytes
                    for p in models.values()]
    shapes = [ModelSpec.from_dir(p).kv_shape(args.dtype) for p in models.values()]
    per_token = max(shape.block_bytes // shape.block_size for shape in shapes)
    kv_bytes = per_token * args.batch * (args.context + 16)
    sizes = rig_sizes(weight_bytes, kv_bytes)
    with switch_rig(models, args.dtype, sizes, args.threads, device=args.device) as rig:
        worker = rig.worker
        say("kv fragmentation workload")
        frag = run_kv_workload(worker.cache, {n: worker.kv_shape(n) for n in names},
                               args.kv_ops, args.seed)
        say("scale-ups")
        worker.switcher.prefetch_enabled = False
        plain = PlainCopy(max(weight_bytes), args.device)
        scale = scale_up_rows(measure_scale_ups(worker.switcher, names, args.repeats, plain))
        del plain
        rows: dict[str, dict[str, Any]] = {r.model: asdict(r) for r in scale}
        for name in names:  # the kernels each model runs (measured at the worker's start)
            rows[name]["isa_choice"] = worker.engine.tune(worker.specs[name], args.dtype).report()
        say("preemptive switches")
        worker.switcher.prefetch_enabled = True
        switches = measure_switches(worker, names, args.batch, args.context,
                                    args.slice_ms / 1e3, args.switch_repeats)
        for name, fields in switches.items():
            rows[name].update(fields)
        say("sanity check")
        small = sorted(names, key=worker.switcher.nbytes)[:2]
        check = check_switches(worker, small[0], small[1], models, args.dtype, seed=args.seed)
        extra = {
            "kv_fragmentation": round(frag.mean, 4),
            "kv_fragmentation_max": round(frag.max, 4),
            "kv_workload": asdict(frag),
            "check": {"models": small, **asdict(check)},
            "num_promotions": worker.switcher.num_promotions,
            "device": args.device,
            "memcpy": plain_kind(args.device),
            "model_cache_pinned": {n: getattr(worker.cache.cached_model(n), "pinned", None)
                                   for n in names},
        }
    return rows, extra


def measure_naive(models: dict[str, Path], rows: dict[str, dict[str, Any]],
                  args: argparse.Namespace, log: Log | None = None) -> dict[str, Any]:
    """Step 5: cold worker, vLLM engine start, transformers; fills ``rows``.

    transformers loads each model as it reads it (`aegaeon_market.readable`): a model
    it cannot read as it is (GGUF blocks, FP8) from its weights dequantized to the
    bench dtype, written once beforehand (untimed), with the reason in the model's
    ``transformers_weights``."""
    from aegaeon_bench.switch.naive import (
        cold_worker,
        transformers_available,
        transformers_load,
        vllm_python,
        vllm_start,
    )

    say = log or (lambda _msg: None)
    python = vllm_python(args.vllm_python, args.no_vllm)
    use_hf = not args.no_transformers and transformers_available()
    with tempfile.TemporaryDirectory(prefix="aegaeon-switch-hf-") as scratch:
        hf_dirs = _transformers_dirs(models, rows, args.dtype, Path(scratch), say) if use_hf \
            else {}
        if hf_dirs:
            transformers_load(next(iter(hf_dirs.values())), args.dtype)  # warm the process
        for name, path in models.items():
            row = rows[name]
            if not args.no_cold:
                say(f"cold worker {name}")
                runs = [cold_worker(path, args.dtype) for _ in range(max(args.cold_repeats, 1))]
                row["cold_worker_s"] = round(statistics.median(r.seconds for r in runs), 4)
                row["cold_worker_phases_s"] = {
                    key: round(statistics.median(r.report[key] for r in runs), 4)
                    for key in ("import_s", "load_s", "first_token_s")
                }
            if name in hf_dirs:
                row["transformers_s"] = round(statistics.median(
                    transformers_load(hf_dirs[name], args.dtype) for _ in range(2)), 4)
    if python is not None:
        for name, path in models.items():
            say(f"vLLM engine start {name}")
            try:
                started = vllm_start(python, path, args.dtype, args.threads)
            except RuntimeError as exc:
                rows[name]["vllm_error"] = str(exc)[-500:]
                continue
            rows[name]["vllm_start_s"] = round(started.seconds, 3)
            rows[name]["vllm_init_s"] = round(float(started.report["init_s"]), 3)
    return {"vllm_python": python}


def _transformers_dirs(models: dict[str, Path], rows: dict[str, dict[str, Any]], dtype: str,
                       scratch: Path, say: Log) -> dict[str, Path]:
    """What transformers loads for each model: its directory, or its weights dequantized
    to ``dtype`` in ``scratch`` (why: in its row's ``transformers_weights``, and said)."""
    from aegaeon_market.readable import transformers_dir, transformers_unreadable

    dirs = {}
    for name, path in models.items():
        why = transformers_unreadable(path)
        if why is not None:
            rows[name]["transformers_weights"] = f"dequantized to {dtype}: {why}"
            say(f"transformers loads {name} dequantized to {dtype}: {why}")
        dirs[name] = transformers_dir(path, scratch, dtype)
    return dirs


def run(args: argparse.Namespace) -> int:
    """Measure, print the tables (and the JSON line); the exit code."""
    from aegaeon_engine import CheckpointError
    from aegaeon_market import MarketError

    from aegaeon_bench.common import machine_info
    from aegaeon_bench.switch.report import print_tables, summarize

    def log(message: str) -> None:
        print(f"switch bench: {message}", file=sys.stderr, flush=True)

    try:
        models = _models(args)
    except (CheckpointError, MarketError, OSError, ValueError) as exc:
        print(f"aegaeon bench switch: error: {exc}", file=sys.stderr)
        return 2
    rows, extra = measure_worker(models, args, log)
    extra.update(measure_naive(models, rows, args, log))
    extra.update({"dtype": args.dtype, "repeats": args.repeats, "batch": args.batch,
                  "context": args.context, "slice_ms": args.slice_ms,
                  "switch_repeats": args.switch_repeats})
    summary = {**machine_info(threads=args.threads), **summarize(rows, extra)}
    print_tables(summary)
    if args.json:
        print(json.dumps(summary))
    return 0
