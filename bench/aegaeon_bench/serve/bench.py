"""``aegaeon bench serve``: open-loop load against a running proxy, scored by the paper's SLO.

Each of the first ``--models`` models of ``GET /v1/models`` receives a
Poisson stream of ``--rps`` requests per second for ``--duration`` seconds.
Lengths follow the ShareGPT-like lognormals of the simulator
(``aegaeon_workload.synthetic``: input median 585 / mean 699 tokens, output
median 265 / mean 294 tokens, the ShareGPT traces of the paper's artifact),
times ``--input-scale`` / ``--output-scale``: 2 gives the paper's
ShareGPT-ix2 / -ox2 (section 7.1); values below 1 shrink ShareGPT to what a
CPU can serve (an H800 decodes a 7B model in 9-18 ms a step and prefills
1024 tokens in ~26 ms; this project's small CPU models take 10-35 ms a step
and ~0.5 ms a prompt token, so 0.25 keeps 4 models at 0.2 RPS each out of
permanent overload on 2 cores). Prompts are random token ids, outputs are
forced (``ignore_eos`` + ``max_tokens``), prompt + output is clipped to the
model's window (``config.json`` from ``--market``, else
``--vocab-size``/``--max-context`` or safe defaults).

Every token's arrival is stamped with ``time.time()``. SLO attainment is the
paper's (section 2.1): token ``k`` meets its deadline when it arrives by
``arrival + TTFT + k * TBT``; the share of all tokens of all requests,
failed and unfinished requests charged every token they should have produced.
The paper uses TTFT 10 s and TBT 100 ms on H800s. Scale TBT to the
hardware's decode step (the paper's is ~5-10x an H800 step) and TTFT with
the output length too: every token's deadline inherits the TTFT slack, so
with ``--output-scale 0.25`` a TTFT of 10 s * 0.25 keeps the slack's share of
a request's span as in the paper. Also reported: the artifact's per-request ``qos``,
TTFT/TBT percentiles, model switches during the run (the instances'
counters), completed and failed requests (``refused``: the failed ones the node
answered 429 past its admission bound). ``--trace FILE`` writes one JSON
line per request plus ``FILE.stats.json`` (the final ``/v1/aegaeon/stats``),
``FILE.kv.jsonl`` (KV cache every ~1 s) and ``FILE.summary.json`` (see
``aegaeon_workload.trace``); ``aegaeon bench report FILE`` draws them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aegaeon_bench import common


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` benchmark parser."""
    parser = common.add_bench(
        sub, "serve", "open-loop load against a running proxy (SLO attainment)", __doc__)
    parser.add_argument("--url", required=True, help="the proxy, e.g. http://127.0.0.1:8000")
    common.add_api_key_argument(parser)
    parser.add_argument("--models", type=int, help="use the first M models (default: all)")
    parser.add_argument("--model", default=None,
                        help="these models by name, comma-separated (instead of --models)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="every prompt this long (default: ShareGPT-like lengths)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help="every output this long (default: ShareGPT-like lengths)")
    parser.add_argument("--rps", type=float, default=0.1, help="requests/s per model (0.1)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    common.add_slo_arguments(parser, 10.0, 0.1, "paper")
    parser.add_argument("--seed", type=int, default=0, help="arrivals, lengths and prompts (0)")
    parser.add_argument("--input-scale", type=float, default=1.0, help="prompt lengths x (1)")
    parser.add_argument("--output-scale", type=float, default=1.0, help="output lengths x (1)")
    parser.add_argument("--market", type=Path, help="market dir: vocab and window per model")
    parser.add_argument("--vocab-size", type=int,
                        help="prompt ids below this (default: config.json, else 256)")
    parser.add_argument("--max-context", type=int, default=4096,
                        help="cap on prompt + output tokens, below the window and the services' "
                        "KV room (4096; the window is 2048 when no config.json is known)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds after the last arrival before open requests fail (30)")
    parser.add_argument("--priority-mix", metavar="MIX",
                        help="SLO classes, e.g. interactive=0.3,batch=0.7: each request sends "
                        "its class as \"priority\"; the JSON gains by_class (attainment per "
                        "class against the class's default targets: interactive 0.5x TTFT, "
                        "batch 5x TTFT and 4x TBT)")
    parser.add_argument("--burst", metavar="SHAPE", help="ON/OFF arrivals, e.g. "
                        "on=5,period=30,factor=10,first=10 (--rps: the OFF rate)")
    parser.add_argument("--trace", type=Path, help="write the per-request trace here")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def _settings(args: argparse.Namespace, models: list[str], limits: dict[str, Any]
              ) -> dict[str, Any]:  # fmt: skip
    return {
        "url": _base_url(args.url), "models": models, "rps_per_model": args.rps,
        "duration_s": args.duration, "seed": args.seed, "input_scale": args.input_scale,
        "output_scale": args.output_scale, "grace_s": args.grace,
        "priority_mix": args.priority_mix, "burst": args.burst,
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "limits": {m: asdict(lim) for m, lim in limits.items()},
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import aiohttp
    from aegaeon_common.market_index import MarketError
    from aegaeon_common.process import run_fast
    from aegaeon_sched.slo import SLO
    from aegaeon_workload.mix import parse_burst, parse_mix
    from aegaeon_workload.plan import model_limits, plan_requests
    from aegaeon_workload.trace import RunFiles, write_json, write_jsonl, write_trace
    from tqdm import tqdm

    from aegaeon_bench.common import machine_info
    from aegaeon_bench.node.client import ServiceError, served_models
    from aegaeon_bench.report.metrics import by_class, counter_delta, per_model, summary
    from aegaeon_bench.serve.output import print_result
    from aegaeon_bench.serve.run import RunOptions, run_load

    try:
        mix = parse_mix(args.priority_mix) if args.priority_mix else ()
        burst = parse_burst(args.burst) if args.burst else None
    except ValueError as exc:
        print(f"aegaeon bench serve: {exc}", file=sys.stderr)
        return 2

    base_url = _base_url(args.url)
    key = common.api_key(args)
    try:
        served = served_models(base_url, key)
        models = served[: args.models] if args.models else served
        if args.model:
            models = [m for m in args.model.split(",") if m]
            unknown = sorted(set(models) - set(served))
            if unknown:
                raise ValueError(f"--model: not served by {base_url}: {', '.join(unknown)} "
                                 f"(served: {', '.join(served)})")
        limits = model_limits(models, args.market, vocab_size=args.vocab_size,
                              max_context=args.max_context)
    except (ServiceError, OSError, MarketError, ValueError) as exc:  # OSError: no answer
        print(f"aegaeon bench serve: {exc}", file=sys.stderr)
        return 2
    planned = plan_requests(models, limits, rps_per_model=args.rps, duration_s=args.duration,
                            seed=args.seed, input_scale=args.input_scale,
                            output_scale=args.output_scale, mix=mix, burst=burst,
                            prompt_tokens=args.prompt_tokens,
                            output_tokens=args.output_tokens)  # fmt: skip
    print(f"{len(planned)} requests to {len(models)} models ({', '.join(models)}) over "
          f"{args.duration:g} s; limits from {sorted({lim.source for lim in limits.values()})}",
          file=sys.stderr)  # fmt: skip
    bar = tqdm(total=len(planned), desc="requests", unit="req", file=sys.stderr, disable=args.quiet)
    num_failed = 0

    def on_done(progress: Any) -> None:
        nonlocal num_failed
        num_failed += not progress.ok
        bar.set_postfix(failed=num_failed, refresh=False)
        bar.update()

    options = RunOptions(base_url, args.duration, grace_s=args.grace, api_key=key)
    try:
        outcome = run_fast(run_load(planned, options, on_done=on_done))
    except (ServiceError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"aegaeon bench serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the open streams are closed by the runner's cleanup
        print("aegaeon bench serve: interrupted, nothing written", file=sys.stderr)
        return 130
    finally:
        bar.close()
    records = outcome.records()
    slo = SLO(args.ttft, args.tbt)
    before, after = outcome.stats_before, outcome.stats_after
    result = summary(records, slo, switches=counter_delta(before, after, "switches"),
                     prefetched_switches=counter_delta(before, after, "prefetched_switches"))
    models_result = per_model(records, slo)
    if mix:
        result["by_class"] = by_class(records, {p.request_id: p.priority for p in planned}, slo)
    roles = (after or {}).get("roles")
    if roles is not None:
        result["roles"] = roles
    # the server's engines run on this machine's CPU and level; their threads are the
    # server config's, which a client cannot see
    result = {**machine_info(), **result}
    if args.trace is not None:
        files = RunFiles(args.trace)
        write_trace(files.trace, records)
        write_json(files.stats, after)
        write_jsonl(files.kv, outcome.kv_samples)
        write_json(files.summary, {"settings": _settings(args, models, limits),
                                   "start_s": outcome.start_s, "end_s": outcome.end_s,
                                   "result": result, "per_model": models_result})  # fmt: skip
        print(f"trace: {files.trace} (+ .stats.json .kv.jsonl .summary.json)", file=sys.stderr)
    print_result(result, models_result, as_json=args.json, out=sys.stdout)
    return 0
