"""``aegaeon bench engine``: prefill and decode tokens/s of our engine, transformers and vLLM.

One run, one checkpoint (default: the default market's bench model), one
dtype (the checkpoint's unless ``--dtype``), the same thread count for every
engine. ``greedy_match`` is the correctness check: our batch-8 greedy tokens
equal transformers' greedy tokens of each prompt decoded alone, both engines in
float32 (in the bench dtype when that is float32). In bf16 the two engines sum
in different orders and a near tie can flip a token; transformers does that to
itself between its batch-8 and batch-1 runs, so the bench-dtype comparisons are
reported beside it, not as the check: ``greedy_match_bench_dtype`` (ours vs
transformers alone), ``greedy_match_hf_b8`` (ours vs transformers' batch-8 run),
``hf_self_match_bench_dtype`` (transformers' batch-8 run vs its own batch-1
runs) and ``greedy_prefix_match_bench_dtype`` (mean share of each prompt's
tokens that agree before the first flip; ``hf_self_prefix_match_bench_dtype``
the same for transformers against itself).
A checkpoint transformers cannot read as it is (GGUF blocks kept, FP8) runs in
transformers from its weights dequantized to the bench dtype
(aegaeon_market.readable; why in ``transformers_weights``); with GGUF blocks ours
decodes with 8-bit activations, so ``greedy_match`` is null (why in
``greedy_match_note``; ``aegaeon bench quant`` measures the agreement).
``--isa LEVEL`` runs ours at that kernel level (``AEGAEON_ISA``) and emulates a
CPU of that level for every engine: the bench re-runs itself in a child
process with ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and
``MKL_ENABLE_INSTRUCTIONS`` capped (set before torch is imported; torch's
capability is in the JSON as ``aten_capability``), so e.g. transformers'
bfloat16 matmuls are emulated and float32 GEMMs use AVX2 as on an AVX2-only
CPU. ``isa`` and ``compute_dtype`` (what ours multiplies bfloat16 weights in)
are reported with the machine (``machine.py``).
``isa`` is the level of ours' decode projection and ``isa_choice`` maps each
operation (``decode_projection``, ``prefill_gemm``, ``attention``) to the
level chosen and the µs measured per level (aegaeon_engine.tuning: the
fastest on this machine, measured once per machine and model shape; a forced
``--isa`` measures nothing). On the CPU the run also measures the core's
limits at the same threads and caps (``machine``: ``peak_gflops``, the better
of torch's float32 and the bench dtype's GEMM, ``peak_gflops_by_dtype``,
``read_gb_s`` of a STREAM-like sum), the model's ``costs_per_token``
(``weight_bytes`` and ``decode_flops`` of a decode step, ``prefill_flops``)
and, per engine, its ``roofline``: prefill GFLOP/s and share of the peak,
decode batch 1's GB/s of weights and share of the read bandwidth, batch 8's
GFLOP/s and share of the peak, batch 8 over batch 1 (roofline.py).
Each engine's numbers are medians over ``--repeats`` runs, every engine's
repeats interleaved so a noisy neighbour hurts all alike. The peers run in
subprocesses of their own interpreters (engine_peers.py) and are null when not
installed, with the reason in ``<peer>_error``: vLLM's CPU build
(``--vllm-python``, scripts/install-vllm) on the checkpoint, llama.cpp
(``--llamacpp-python``, scripts/install-llamacpp) on a GGUF file written from
the checkpoint in the bench dtype (aegaeon_market.gguf_export: bf16 stays
BF16, kept GGUF blocks stay as they are), both with the bench's threads, cores, prompts and lengths.
``ours_over_<peer>`` holds ours / the peer per number, ``<peer>_greedy_match``
whether the peer's batch-8 greedy tokens equal ours (in bf16 a near tie may
flip; ``<peer>_greedy_prefix_match`` is the share before the first flip) and
``llamacpp_info`` llama.cpp's version, build flags and context settings. What
each number means is in runs.py, vllm_peer.py and llamacpp_peer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from aegaeon_common.market_index import MARKET_DIR_HELP

KEYS = ("prefill_tok_s", "decode_tok_s_b1", "decode_tok_s_b8")
PEERS = ("vllm", "llamacpp")  # engines in interpreters of their own (engine_peers.py)
ENGINES = ("ours", "transformers", *PEERS)
BATCH = 8
# per level, the environment that caps torch (ATen kernels, oneDNN) to what such a CPU has
# (MKL runs torch's float32 GEMMs: capped too, else an "AVX2" float32 matmul uses AVX-512)
EMULATE: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
    "neon": {},
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``engine`` benchmark parser."""
    parser = sub.add_parser("engine", help="engine tokens/s vs transformers, vLLM and llama.cpp",
                            description=__doc__)
    parser.add_argument("--model", help="checkpoint dir, or the name of a model of the market "
                        "(default: the market's bench model)")
    parser.add_argument("--market", type=Path, help=MARKET_DIR_HELP)
    parser.add_argument("--dtype", help="serving dtype (default: the checkpoint's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--device", default="cpu",
                        help="where ours and transformers run: cpu (default) or cuda[:N]")
    parser.add_argument("--cpus", help="cores every engine is pinned to, e.g. 0 or 0-3 "
                        "(default: 0..threads-1, as vLLM pins itself; 'none': no pinning)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--vllm-python", help="interpreter with vllm installed "
                        "(default: this one if it can import vllm; see scripts/install-vllm)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--llamacpp-python", help="interpreter with llama_cpp installed "
                        "(default: scripts/install-llamacpp's venv if there, else this one "
                        "if it can import llama_cpp)")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--llamacpp-gguf", type=Path, help="the GGUF file llama.cpp runs "
                        "(default: one written from the checkpoint in the bench dtype); e.g. "
                        "the file a quantized model was imported from")
    parser.add_argument("--reference", help="checkpoint dir or market model ours also runs "
                        "in the same rounds (reference, ours_over_reference), and ours' top-1 "
                        "agreement with it, teacher-forced over its greedy text "
                        "(aegaeon_bench.engine.agreement), in top1_agreement")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--isa", choices=sorted(EMULATE),
                        help="our kernels' level, every engine capped to such a CPU "
                        "(default: the best this CPU has, nothing capped)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def _emulate(args: argparse.Namespace) -> int | None:
    """With ``--isa``: run this bench again in a child whose environment caps torch and
    names the level (torch reads its caps once, at import); its exit code. None: this
    process is that child, or there is nothing to cap."""
    from aegaeon_common.env import read_env

    if args.isa is None or read_env().isa == args.isa:
        return None
    env = dict(os.environ, AEGAEON_ISA=args.isa, **EMULATE[args.isa])
    argv = [sys.executable, "-m", "aegaeon_cli.main", *sys.argv[1:]]
    return subprocess.run(argv, env=env, check=False).returncode


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None and Path(args.model).is_dir():
        return Path(args.model)
    from aegaeon_market import default_bench_model, default_market_dir, ensure_market
    from aegaeon_market.manifest import market_model

    market = Path(args.market) if args.market else default_market_dir()
    if args.market is None:  # the default market as `aegaeon serve` builds it, once
        ensure_market(market, progress=False, real_models=True)
    if args.model is not None:  # a market name (ValueError names the market's models)
        return Path(market_model(market, args.model).path)
    return Path(default_bench_model(market).path)


def _medians(values: Any) -> dict[str, float]:
    runs = (values.prefill, values.decode_b1, values.decode_b8)
    return {key: round(statistics.median(v), 1) for key, v in zip(KEYS, runs, strict=True)}


def _pin(args: argparse.Namespace) -> str | None:
    """Pin this process (ours and transformers) to the cores vLLM's worker will use.

    vLLM binds its compute threads to cores; on a shared machine a pinned
    process keeps its core while unpinned ones get migrated around it, so
    every engine gets the same binding or none does.
    """
    spec = args.cpus or (f"0-{args.threads - 1}" if args.threads > 1 else "0")
    if spec == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    os.sched_setaffinity(0, cpus)
    return spec


def _start_peers(args: argparse.Namespace, result: dict[str, Any], prompts: list[list[int]],
                 scratch: Path) -> dict[str, Any]:
    """The peers' workers that started (name -> `PeerWorker`); why the others did not is in
    ``result`` (``<name>_error``) and printed. llama.cpp gets the checkpoint as a GGUF file
    in the bench dtype, written into ``scratch``."""
    from aegaeon_bench.engine.peers import (
        LLAMACPP,
        VLLM,
        peer_python,
        start_peer,
        write_peer_gguf,
    )

    model_dir, dtype = Path(result["model"]), result["dtype"]
    base = {"threads": args.threads, "cpus": result["cpus"], "prompts": prompts,
            "num_new": args.new_tokens}
    workers: dict[str, Any] = {}
    python = None if args.no_vllm else peer_python(VLLM, args.vllm_python, result)
    if python is not None:
        work = {**base, "model": str(model_dir), "dtype": dtype}
        workers[VLLM.name] = start_peer(VLLM, python, work, result)
    python = None
    if not args.no_llamacpp and args.device != "cpu":  # the build is llama.cpp's CPU backend
        result["llamacpp_error"] = f"a CPU build; ours ran on {args.device}"
    elif not args.no_llamacpp:
        python = peer_python(LLAMACPP, args.llamacpp_python, result)
    gguf = (None if python is None else args.llamacpp_gguf
            or write_peer_gguf(model_dir, dtype, scratch, result))
    if python is not None and gguf is not None:
        workers[LLAMACPP.name] = worker = start_peer(LLAMACPP, python,
                                                     {**base, "gguf": str(gguf)}, result)
        if worker is not None:
            result["llamacpp_info"] = {k: v for k, v in worker.ready.items() if k != "ready"}
    return {name: worker for name, worker in workers.items() if worker is not None}


def run(args: argparse.Namespace) -> int:
    """Measure, print a table (and JSON); returns the exit code."""
    code = _emulate(args)
    if code is not None:
        return code
    with tempfile.TemporaryDirectory(prefix="aegaeon-engine-bench-") as scratch:
        return _measure(args, Path(scratch))


def _transformers_weights(model_dir: Path, dtype: str, scratch: Path,
                          result: dict[str, Any]) -> Path:
    """What transformers loads (`aegaeon_market.readable`): the checkpoint, or its weights
    dequantized to ``dtype`` in ``scratch`` (why: ``transformers_weights``, and said)."""
    from aegaeon_market.readable import transformers_dir, transformers_unreadable

    why = transformers_unreadable(model_dir)
    if why is not None:
        result["transformers_weights"] = f"dequantized to {dtype}: {why}"
        print(f"aegaeon bench engine: transformers runs the weights dequantized to {dtype}: "
              f"{why}", file=sys.stderr)
    return transformers_dir(model_dir, scratch, dtype)


def _measure(args: argparse.Namespace, scratch: Path) -> int:
    """`run` past the ISA emulation; ``scratch`` holds the files written for the peers."""
    import torch
    from aegaeon_engine import CheckpointError, ModelSpec
    from aegaeon_engine.spec import QUANT_BLOCKS

    from aegaeon_bench.common import machine_info
    from aegaeon_bench.engine.agreement import bench_prompts
    from aegaeon_bench.engine.roofline import machine_limits, model_costs, roofline
    from aegaeon_bench.engine.runs import OursRunner, Timings, TransformersRunner, Workload

    try:
        model_dir = _model_dir(args)
        spec = ModelSpec.from_dir(model_dir)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"aegaeon bench engine: error: {exc}", file=sys.stderr)
        return 2
    dtype = args.dtype or spec.dtype
    try:
        cpus = _pin(args)
    except (ValueError, OSError) as exc:
        print(f"aegaeon bench engine: error: --cpus {args.cpus!r}: {exc}", file=sys.stderr)
        return 2
    prompts = bench_prompts(spec.vocab_size, BATCH, args.prompt_len, args.seed)
    work = Workload(model_dir, dtype, prompts, args.new_tokens, args.device)
    runners: dict[str, Any] = {"ours": OursRunner(work, args.threads)}
    weights: dict[str, Any] = {}  # why transformers runs other weights, if it does
    if not args.no_transformers:
        hf_dir = _transformers_weights(model_dir, dtype, scratch, weights)
        runners["transformers"] = TransformersRunner(replace(work, hf_dir=hf_dir), args.threads)
    ref_dir = None
    if args.reference is not None:  # ours on the reference model, in the same rounds
        ref_dir = _model_dir(argparse.Namespace(**{**vars(args), "model": args.reference}))
        runners["reference"] = OursRunner(Workload(ref_dir, dtype, prompts, args.new_tokens,
                                                   args.device), args.threads)
    timings = {name: Timings() for name in runners}
    for runner in runners.values():  # warm-up: allocator, oneDNN kernels, rope tables
        runner.run(Timings())
    engine = runners["ours"].engine
    result: dict[str, Any] = {
        **machine_info(engine.isa, args.threads),
        "model": str(model_dir), "dtype": dtype, "compute_dtype": (
            engine.compute_dtype if dtype == "bfloat16" else dtype),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch": BATCH,
        "repeats": args.repeats, "cpus": cpus, **dict.fromkeys(PEERS),
        "native_kernels": engine.native_kernels,
        "isa_choice": runners["ours"].choice.report(),
        "device": args.device, "device_name": (  # the GPU's name (None on the CPU)
            torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None),
        **weights,
    }
    if args.device == "cpu":  # the core's limits, measured here, at these threads and caps
        result["machine"] = machine_limits(dtype)
    peers = _start_peers(args, result, prompts, scratch)
    peer_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    try:
        for _ in range(args.repeats):  # interleaved rounds: every engine sees the same noise
            for name, runner in runners.items():
                runner.run(timings[name])
            for name, worker in list(peers.items()):
                try:
                    peer_runs[name].append(worker.run())
                except RuntimeError as exc:
                    result[f"{name}_error"] = str(exc)
                    print(f"aegaeon bench engine: {exc}", file=sys.stderr)
                    peer_runs[name].clear()
                    peers.pop(name).close()
    finally:
        for worker in peers.values():
            worker.close()
    for name in ("ours", "transformers"):
        result[name] = _medians(timings[name]) if name in timings else None
    if ref_dir is not None:
        ref = result["reference"] = {**_medians(timings["reference"]), "model": str(ref_dir)}
        result["ours_over_reference"] = {k: round(result["ours"][k] / ref[k], 2) for k in KEYS}
    _peer_results(result, peer_runs, timings["ours"].tokens_b8)
    if "machine" in result:
        dense = model_costs(spec, getattr(torch, dtype).itemsize, args.prompt_len)
        costs = dict(dense)
        if spec.quant is not None:  # the bytes a decode step streams: all but the embeddings
            layout = engine.layout(spec, dtype)
            embed = 0 if spec.tie_word_embeddings else layout.slot("embed_tokens").nbytes
            costs["weight_bytes"] = layout.total_bytes - embed
        result["costs_per_token"] = costs
        result["roofline"] = {  # transformers on dequantized weights streams the dense bytes
            name: roofline(dense if name == "transformers" and "transformers_weights" in result
                           else costs, result["machine"], result[name])
            for name in ENGINES if result.get(name)}
    hf = result["transformers"]
    result["decode_speedup_vs_transformers_b8"] = (
        round(result["ours"]["decode_tok_s_b8"] / hf["decode_tok_s_b8"], 2) if hf else None)
    result["greedy_match"] = None
    if hf:
        _compare_greedy(result, timings["ours"].tokens_b8, timings["transformers"].tokens_b8,
                        runners["transformers"].greedy_alone())  # fmt: skip
    blocks = spec.quant.linear if spec.quant is not None else None
    if hf and blocks in QUANT_BLOCKS:  # 8-bit activations against float ones: close, not equal
        result["greedy_match"] = None
        result["greedy_match_note"] = (
            f"{blocks} decodes with 8-bit activations (as llama.cpp does), "
            "transformers in float on the dequantized weights: `aegaeon bench quant` measures "
            "how close they are")  # fmt: skip
    elif hf and dtype != "float32":
        exact = Workload(model_dir, "float32", prompts, args.new_tokens, args.device,
                         hf_dir=_transformers_weights(model_dir, "float32", scratch, {}))
        result["greedy_match"] = (OursRunner(exact, args.threads).greedy()
                                  == TransformersRunner(exact, args.threads).greedy_alone())
    if ref_dir is not None:
        from aegaeon_bench.engine.agreement import top1_agreement

        result["top1_agreement"] = top1_agreement(model_dir, ref_dir, prompts, args.new_tokens,
                                                  dtype, args.threads)
    _print_table(result)
    if ref_dir is not None:
        print(f"ours on the reference {ref_dir.name}: {result['reference']}; ours over it: "
              f"{result['ours_over_reference']}; top-1 agreement: {result['top1_agreement']}")
    if args.json:
        print(json.dumps(result))
    return 0


def _peer_results(result: dict[str, Any], peer_runs: dict[str, list[dict[str, Any]]],
                  ours_b8: list[list[int]]) -> None:
    """Each peer's medians (null when it did not run), ours over it, its greedy agreement."""
    for name in PEERS:
        runs = peer_runs.get(name)
        if runs:
            result[name] = {k: round(statistics.median(r[k] for r in runs), 1) for k in KEYS}
            result[f"{name}_greedy_match"] = runs[-1]["tokens_b8"] == ours_b8
            result[f"{name}_greedy_prefix_match"] = _prefix_share(runs[-1]["tokens_b8"], ours_b8)
        peer = result.get(name)
        result[f"ours_over_{name}"] = ({k: round(result["ours"][k] / peer[k], 2) for k in KEYS}
                                       if peer else None)


def _print_table(result: dict[str, Any]) -> None:
    print(f"engine bench: {Path(result['model']).name} {result['dtype']}, "
          f"{result['threads']} thread(s) on cpus {result['cpus']}, "
          f"prompts {result['batch']} x {result['prompt_len']}, "
          f"{result['new_tokens']} new tokens, median of {result['repeats']} (tokens/s)")
    print(f"{result['cpu_model']}, torch {result['torch']} (ATen {result['aten_capability']}); "
          f"ours on {result['isa']} kernels, arithmetic in {result['compute_dtype']}")
    print(f"{'engine':14}{'prefill':>12}{'decode b1':>12}{'decode b8':>12}")
    for name in ENGINES:
        row = result.get(name)
        cells = [f"{row[k]:12.1f}" for k in KEYS] if row else [f"{'n/a':>12}"] * 3
        print(f"{name:14}{''.join(cells)}")
    print(f"decode speedup vs transformers at b8: {result['decode_speedup_vs_transformers_b8']}")
    for name in PEERS:
        ratios = result.get(f"ours_over_{name}")
        if ratios:
            shown = ", ".join(f"{k} {v}x" for k, v in ratios.items())
            print(f"ours / {name}: {shown}; greedy tokens equal ours: "
                  f"{result[f'{name}_greedy_match']} "
                  f"({100 * result[f'{name}_greedy_prefix_match']:.0f}% before the first flip)")
    _print_roofline(result)
    print(f"greedy tokens (ours, batch 8) equal transformers' decoding each prompt alone, "
          f"in float32: {result['greedy_match']}")
    if result.get("greedy_match_note"):
        print(f"  ({result['greedy_match_note']})")
    if result["dtype"] != "float32" and result.get("greedy_match_bench_dtype") is not None:
        print(f"  in {result['dtype']}: {result['greedy_match_bench_dtype']} "
              f"({100 * result['greedy_prefix_match_bench_dtype']:.0f}% of tokens agree before "
              f"the first flip); transformers' batch-8 run equals its own batch-1 runs: "
              f"{result['hf_self_match_bench_dtype']} "
              f"({100 * result['hf_self_prefix_match_bench_dtype']:.0f}% agree)")


def _print_roofline(result: dict[str, Any]) -> None:
    """The kernels chosen, the machine's limits and each engine against them."""
    for op, chosen in result["isa_choice"].items():
        timed = ", ".join(f"{k} {v:.0f}" for k, v in chosen["us"].items()) or "not measured"
        print(f"kernels: {op} {chosen['level']} (µs: {timed})")
    machine = result.get("machine")
    if not machine:
        return
    print(f"machine: matmul peak {machine['peak_gflops']} GFLOP/s "
          f"({', '.join(f'{k} {v}' for k, v in machine['peak_gflops_by_dtype'].items())}), "
          f"read {machine['read_gb_s']} GB/s")
    for name, row in result["roofline"].items():
        print(f"  {name:12} prefill {row['prefill_gflops']} GFLOP/s "
              f"({100 * row['prefill_peak_share']:.0f}% of peak); decode b1 "
              f"{row['decode_b1_gb_s']} GB/s ({100 * row['decode_b1_read_share']:.0f}% of read); "
              f"b8 {row['decode_b8_gflops']} GFLOP/s ({100 * row['decode_b8_peak_share']:.0f}%), "
              f"{row['b8_over_b1']}x b1")


def _compare_greedy(result: dict[str, Any], ours: list[list[int]], hf_b8: list[list[int]],
                    hf_alone: list[list[int]]) -> None:  # fmt: skip
    """The bench-dtype comparisons (see the module docstring); ``greedy_match`` as the dtype's."""
    result["greedy_match_bench_dtype"] = result["greedy_match"] = ours == hf_alone
    result["greedy_match_hf_b8"] = ours == hf_b8
    result["hf_self_match_bench_dtype"] = hf_b8 == hf_alone
    result["greedy_prefix_match_bench_dtype"] = _prefix_share(ours, hf_alone)
    result["hf_self_prefix_match_bench_dtype"] = _prefix_share(hf_b8, hf_alone)


def _prefix_share(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Mean share of each reference sequence that ``ours`` repeats before differing."""
    shares = []
    for a, b in zip(ours, ref, strict=True):
        pairs = zip(a, b, strict=False)
        same = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(b), 1))
    return round(sum(shares) / max(len(shares), 1), 3)
