"""``aegaeon bench lora``: ``bench serve``'s load on one base with N LoRA adapters, beside
the same load on the base alone and on N full-weight copies of the base.

One run, three nodes started one after another on this machine with the same
config (``--market``'s model ``--base``, default SmolLM2-135M-Instruct):

- ``adapters``: the base and N seeded random adapters (``market add
  --random-adapter``, rank ``--rank`` on ``--targets``); stream i asks adapter i;
- ``base``: the base alone; stream i's requests ask the base;
- ``copies``: N copies of the base, each a full model of its own in the Model
  Cache; stream i asks copy i.

Each stream is ``bench serve``'s: a Poisson stream of ``--rps`` requests per
second for ``--duration`` seconds, ShareGPT-like lengths scaled by
``--input-scale`` / ``--output-scale`` (or fixed ``--prompt-tokens`` /
``--output-tokens``); the three runs get the very same requests (arrival,
lengths, prompt), only the model names differ. Every model gets one request
first (warm-up: the weights and adapters reach the Model Cache and the
device); then the run is measured: model switches (the instances' counters,
i.e. ``aegaeon_model_switches_total``), adapters brought to the device, SLO
attainment (the paper's token deadlines), decode tokens/s of the decode
instances' engine time and their mean batch (tokens per step), decode tokens/s
per batch size (each decode turn's tokens over its engine time, by its mean
batch), generated tokens/s of wall time, and the Model Cache's bytes.
``--repeats R`` runs the cases R times, interleaved (base, adapters, copies,
base, ...), and reports each case's medians: a shared machine's other work
then falls on every case alike. The comparison: the adapters' attainment over
the base's, and their decode tokens/s over the base's at the same batch sizes
(token-weighted over the sizes both saw). ``--json``: the last line of stdout is
the report; ``--out DIR`` keeps the markets, node logs and one JSON file per
run. The CPU is named beside the numbers, with the machine's load average before
and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from aegaeon_bench import common

CASES = ("base", "adapters", "copies")
DEFAULT_BASE = "smollm2-135m-instruct"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "lora", "one base and N LoRA adapters against the base alone and N copies",
        __doc__)  # fmt: skip
    common.add_node_arguments(parser)
    parser.add_argument("--base", default=DEFAULT_BASE,
                        help=f"the market's model the adapters adapt ({DEFAULT_BASE})")
    parser.add_argument("--adapters", type=int, default=8, help="N: adapters and streams (8)")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank (8)")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj",
                        help="the adapters' target_modules (q_proj,k_proj,v_proj,o_proj)")
    parser.add_argument("--rps", type=float, default=0.1, help="requests/s per stream (0.1)")
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds of arrivals (120)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="every prompt this long (default: ShareGPT-like lengths)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help="every output this long (default: ShareGPT-like lengths)")
    parser.add_argument("--input-scale", type=float, default=0.25, help="prompt lengths x (0.25)")
    parser.add_argument("--output-scale", type=float, default=0.5,
                        help="output lengths x (0.5)")
    common.add_slo_arguments(parser, 10.0, 0.1, "paper")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds after the last arrival before open requests fail (60)")
    parser.add_argument("--seed", type=int, default=0, help="arrivals, lengths, prompts (0)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"which runs, in this order ({','.join(CASES)})")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the cases this many times, interleaved; medians (1)")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the markets, logs and reports here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def _usage(args: argparse.Namespace) -> str | None:
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        return f"--cases: {','.join(unknown) or 'none'}: choose from {','.join(CASES)}"
    if args.adapters < 1:
        return "--adapters must be at least 1"
    if args.rps <= 0 or args.duration <= 0:
        return "--rps and --duration must be positive"
    if args.repeats < 1:
        return "--repeats must be at least 1"
    return None


def build_markets(market: Path, base: str, out: Path, num: int, rank: int,
                  targets: list[str]) -> dict[str, tuple[Path, list[str]]]:  # fmt: skip
    """Per case: its market (in ``out``, the base linked in, not copied) and the model
    each stream asks."""
    from aegaeon_common.market_index import Manifest, MarketError, read_manifest
    from aegaeon_market.adapters import add_random_adapter
    from aegaeon_market.manifest import write_manifest

    entry = next((e for e in read_manifest(market).entries if e.name == base), None)
    if entry is None or entry.adapter:
        raise MarketError(f"--base {base!r}: not a model of {market}")

    def linked(name: str, names: list[str]) -> Path:
        root = out / f"market-{name}"
        root.mkdir(parents=True, exist_ok=True)
        entries = []
        for model in names:
            link = root / model
            if not link.exists():
                link.symlink_to(entry.path.resolve(), target_is_directory=True)
            entries.append(replace(entry, name=model, path=link, role=""))
        write_manifest(root, Manifest(0, "", "", tuple(entries)))
        return root

    adapters = [f"{base}-lora{i}" for i in range(num)]
    copies = [f"{base}-copy{i}" for i in range(num)]
    with_adapters = linked("adapters", [base])
    for i, name in enumerate(adapters):
        add_random_adapter(with_adapters, name, base, rank, targets, seed=i)
    return {
        "base": (linked("base", [base]), [base] * num),
        "adapters": (with_adapters, adapters),
        "copies": (linked("copies", copies), copies),
    }


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def by_batch(stats: dict[str, Any] | None, since_s: float) -> dict[int, list[float]]:
    """Decode tokens and engine seconds by batch size (a turn's tokens per step, rounded)
    over the decode turns that started at ``since_s`` or later."""
    out: dict[int, list[float]] = {}
    for turn in (stats or {}).get("turns") or []:
        steps, tokens, seconds = turn.get("steps", 0), turn.get("tokens", 0), turn.get("engine_s")
        if turn.get("start_s", 0.0) < since_s or not steps or not seconds:
            continue
        acc = out.setdefault(round(tokens / steps), [0.0, 0.0])
        acc[0] += tokens
        acc[1] += seconds
    return out


def same_batch_ratio(ours: dict[int, list[float]], base: dict[int, list[float]]) -> float | None:
    """Our decode tokens/s over ``base``'s at the batch sizes both saw, weighted by the
    tokens the smaller side decoded at each."""
    weight = total = 0.0
    for size in set(ours) & set(base):
        (t1, s1), (t0, s0) = ours[size], base[size]
        w = min(t1, t0)
        total += w * (t1 / s1) / (t0 / s0)
        weight += w
    return round(total / weight, 3) if weight else None


def _engine(stats: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any]:
    """The decode instances' work during the run: tokens, steps, engine seconds."""
    from aegaeon_workload.stats_json import instance_counter

    from aegaeon_bench.report.metrics import counter_delta

    tokens = counter_delta(before, stats, "tokens") or 0
    steps = counter_delta(before, stats, "steps") or 0
    seconds = instance_counter(stats, "decode_s") - instance_counter(before, "decode_s")
    return {"decode_tokens": tokens, "decode_steps": steps,
            "decode_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
            "mean_batch": round(tokens / steps, 2) if steps else None}  # fmt: skip


def run_case(name: str, market: Path, streams: list[str], args: argparse.Namespace,
             work: Path) -> dict[str, Any]:  # fmt: skip
    """Start the case's node, warm every model up, run the load, stop the node."""
    import time

    from aegaeon_common.process import run_fast
    from aegaeon_sched.slo import SLO
    from aegaeon_workload.plan import model_limits, plan_requests

    from aegaeon_bench.node.launch import slo_config, start_node
    from aegaeon_bench.report.metrics import counter_delta, summary
    from aegaeon_bench.serve.run import RunOptions, run_load

    names = [f"stream{i}" for i in range(len(streams))]
    limits = model_limits(sorted(set(streams)), market, max_context=4096)
    planned = plan_requests(names, {n: limits[m] for n, m in zip(names, streams, strict=True)},
                            rps_per_model=args.rps, duration_s=args.duration, seed=args.seed,
                            input_scale=args.input_scale, output_scale=args.output_scale,
                            prompt_tokens=args.prompt_tokens,
                            output_tokens=args.output_tokens)  # fmt: skip
    by_stream = dict(zip(names, streams, strict=True))
    planned = [replace(p, model=by_stream[p.model]) for p in planned]  # the case's names
    config = slo_config(market, args.config, args.ttft, args.tbt, work / name)
    node = start_node(market, "aegaeon", work / name, config)
    try:
        warm = [replace(planned[0], request_id=f"warm-{k}", model=model, offset_s=0.1 * k,
                        max_tokens=4) for k, model in enumerate(dict.fromkeys(streams))]
        run_fast(run_load(warm, RunOptions(node.url, 1.0, grace_s=300.0)))
        load_before = _loadavg()
        started, started_wall = time.monotonic(), time.time()
        outcome = run_fast(run_load(planned, RunOptions(node.url, args.duration,
                                                        grace_s=args.grace)))
        wall_s = time.monotonic() - started
    finally:
        node.stop()
    records = outcome.records()
    before, after = outcome.stats_before, outcome.stats_after
    result = summary(records, SLO(args.ttft, args.tbt),
                     switches=counter_delta(before, after, "switches"))  # fmt: skip
    cache = ((after or {}).get("cache") or {}).get("model_cache") or {}
    result.update(_engine(after, before))
    batches = by_batch(after, started_wall)
    result["by_batch"] = {str(k): {"tokens": int(t), "engine_s": round(s, 3),
                                   "tokens_per_s": round(t / s, 2)}
                          for k, (t, s) in sorted(batches.items())}  # fmt: skip
    result.update({
        "case": name, "models": sorted(set(streams)),
        "adapter_loads": counter_delta(before, after, "adapter_loads"),
        "generated_tokens_per_s": round(result["tokens_received"] / wall_s, 2),
        "model_cache_bytes": cache.get("used_bytes"),
        "loadavg_before": load_before, "loadavg_after": _loadavg(),
    })  # fmt: skip
    (work / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _batches(run: dict[str, Any]) -> dict[int, list[float]]:
    return {int(k): [v["tokens"], v["engine_s"]] for k, v in run.get("by_batch", {}).items()}


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The adapters' runs against the base alone's: attainment, decode tokens/s at the
    same batch sizes (each repeat against the one beside it; medians), switches."""
    import statistics

    base, lora = results.get("base"), results.get("adapters")
    if base is None or lora is None:
        return {}
    pairs = list(zip(base["runs"], lora["runs"], strict=True))
    attain = [b2["slo_attainment"] / b1["slo_attainment"] for b1, b2 in pairs
              if b1["slo_attainment"]]
    speed = [r for b1, b2 in pairs if (r := same_batch_ratio(_batches(b2), _batches(b1)))]
    return {"attainment_vs_base": round(statistics.median(attain), 3) if attain else None,
            "decode_tokens_per_s_same_batch_vs_base":
                round(statistics.median(speed), 3) if speed else None,
            "adapter_switches": [r["switches"] for r in lora["runs"]]}  # fmt: skip


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case's runs: each number's median, the last run's other fields, every run."""
    import statistics

    out = dict(runs[-1])
    for key, value in runs[-1].items():
        numbers = [r[key] for r in runs if isinstance(r.get(key), int | float)
                   and not isinstance(r.get(key), bool)]  # fmt: skip
        if isinstance(value, int | float) and not isinstance(value, bool) and numbers:
            out[key] = statistics.median(numbers)
    out["runs"] = runs
    return out


def _print(results: dict[str, dict[str, Any]], report: dict[str, Any]) -> None:
    print(f"{report['cpu_model']} (isa {report['isa']}), streams {report['streams']} x "
          f"{report['rps']} req/s for {report['duration_s']:g} s, medians of "
          f"{report['repeats']} interleaved runs")
    head = ("case", "switches", "adapter loads", "attainment", "decode tok/s", "mean batch",
            "gen tok/s", "Model Cache MiB", "load avg")
    print("  ".join(f"{h:>15}" for h in head))
    for name, r in results.items():
        cache = r["model_cache_bytes"]
        row = (name, r["switches"], r["adapter_loads"], f"{r['slo_attainment']:.3f}",
               r["decode_tokens_per_s"], r["mean_batch"], r["generated_tokens_per_s"],
               f"{cache / 2**20:.0f}" if cache is not None else "-",
               "/".join(f"{x:g}" for x in r["loadavg_after"]))
        print("  ".join(f"{v!s:>15}" for v in row))
    for key, value in report["compare"].items():
        print(f"{key}: {value}")


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.market_index import MarketError, default_market_dir
    from aegaeon_engine.errors import CheckpointError

    from aegaeon_bench.common import machine_info
    from aegaeon_bench.node.launch import NodeError

    usage = _usage(args)
    if usage is not None:
        print(f"aegaeon bench lora: {usage}", file=sys.stderr)
        return 2
    market = args.market if args.market is not None else default_market_dir()
    work = args.out or Path(tempfile.mkdtemp(prefix="aegaeon-bench-lora-"))
    targets = [t for t in args.targets.split(",") if t]
    cases = [c for c in args.cases.split(",") if c]
    try:
        markets = build_markets(market, args.base, work, args.adapters, args.rank, targets)
        runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
        for k in range(args.repeats):
            for case in cases:
                runs[case].append(run_case(case, *markets[case], args, work / f"run{k}"))
        results = {case: medians(case_runs) for case, case_runs in runs.items()}
    except (MarketError, CheckpointError, NodeError, OSError) as exc:
        print(f"aegaeon bench lora: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    report = {**machine_info(), "base": args.base, "streams": args.adapters, "rps": args.rps,
              "duration_s": args.duration, "rank": args.rank, "targets": targets,
              "repeats": args.repeats,
              "results": results, "compare": compare(results), "out": str(work)}  # fmt: skip
    _print(results, report)
    if args.json:
        print(json.dumps(report))
    return 0
