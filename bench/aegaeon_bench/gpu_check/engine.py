"""``scripts/gpu-check --scenario engine``'s measurement: the decode step on one GPU.

``python -m aegaeon_bench.gpu_check.engine --device cuda --json`` measures, in one
process, for ``llama-3.1-8b`` bf16, ``llama-3.1-8b`` FP8 and ``llama-3.2-3b`` bf16
(the market's presets, ``market add --random``'s configs, with random weights
written straight into the device arena: nothing of 16 GB goes through a disk)
and a small model (``qwen2.5-0.5b``) beside them:

- ``decode``: ms per decode step at batch 1, 8 and 32, with contexts of 512 and
  2048 tokens and with mixed lengths in one batch (128 to 2048, spread evenly;
  batch 1: their mean), eager and on CUDA graphs, each the median of
  ``steps`` steps; per step the HBM roofline (weight plus KV bytes read, over
  the device-to-device bandwidth measured in this run) and the share reached;
- ``small_after``: the small model's step (batch 8, mixed) right after each big
  model's, against its step measured before any big model ran;
- ``prefill_tok_s`` of one 2048-token prompt;
- ``kernels``: the attention kernels the profiler saw in an eager decode step and
  a prefill (CUDA graphs hide their kernels from it);
- ``greedy_equal``: a batch of 8 decoded 16 tokens greedily, eager and on
  graphs: the same tokens;
- ``wake_to_first_token_s`` (FP8): the model's packed bytes copied from pinned
  host memory (where the Model Cache keeps them) into the arena, bound, and one
  decode step of a batch of 8, no prefetch; the path through the Model Cache
  with its KV swaps is the scenario's ``fp8_switch`` step;
- ``transformers``: the same batches and contexts on transformers (random
  weights of the same config on the same GPU): its static cache under
  ``torch.compile`` where the budget allows (llama-3.1-8b bf16 first), else its
  eager ``sdpa`` path; ``mode`` says which ran, per shape; ours over theirs in
  decode tokens/s. The FP8 model's peer is transformers' bf16 model of its preset
  (``peer_of``).
- ``targets``: the issue's bounds and whether each held.

``--tiny`` (the dry run, on the CPU): the same plan with the presets shrunk to two
narrow layers over a vocabulary of 2,048 ids, the contexts to an eighth, and one
timed step (one timed generate of the peer) per measurement; on the CPU the
"graphs" runs the engine's static step on its eager capturer (the plumbing a GPU
replays) and the peer runs eager. The last stdout line is the JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from aegaeon_bench.gpu_check.engine_plan import (
    BATCHES,
    BIG,
    FP8_B1_MS,
    GREEDY_BATCH,
    GREEDY_TOKENS,
    MIXED,
    ROOFLINE_BOUNDS,
    SMALL,
    SMALL_AFTER_RATIO,
    WAKE_S,
    Plan,
    model_spec,
)

BLOCK_SIZE = 16

def fill_random(spec: Any, layout: Any, buffer: Any, seed: int) -> None:
    """Random weights of the layout's scale into ``buffer`` (on its device): matrices
    ~N(0, 0.02) (FP8: codes of it, row scales), norms 1, biases 0."""
    import torch
    from aegaeon_engine import fp8

    gen = torch.Generator(device=buffer.device).manual_seed(seed)
    for slot in layout.slots:
        raw = buffer[slot.offset:slot.offset + slot.nbytes]
        if slot.dtype == "float8_e4m3fn":
            rows, cols = slot.shape
            codes = raw[:rows * cols].view(torch.float8_e4m3fn).view(rows, cols)
            for first in range(0, rows, 2048):  # a block of rows at a time: little memory
                w = torch.randn(min(2048, rows - first), cols, generator=gen,
                                device=buffer.device) * 0.02
                c, s = fp8.quantize(w)
                codes[first:first + c.shape[0]] = c
                start = slot.offset + fp8_scales_offset(rows, cols) + 4 * first
                buffer[start:start + 4 * s.numel()].view(torch.float32).copy_(s)
            continue
        typed = raw.view(getattr(torch, slot.dtype))
        if len(slot.shape) == 1:
            typed.fill_(0.0 if slot.name.endswith("bias") else 1.0)
        else:
            typed.copy_(torch.randn(typed.numel(), generator=gen, device=buffer.device) * 0.02)


def fp8_scales_offset(rows: int, cols: int) -> int:
    from aegaeon_common.dtypes import fp8_scales_offset as offset

    return int(offset(rows, cols))


class Bench:
    """Our engine on the device: an arena (a big model at 0, the small one after the
    largest) and a KV region for the largest batch, as a worker's buffer."""

    def __init__(self, device: str, plan: Plan, specs: Sequence[Any], small: Any) -> None:
        import torch
        from aegaeon_engine import Engine, weight_layout

        self.torch = torch
        self.device = torch.device(device)
        self.plan = plan
        self.on_cuda = self.device.type == "cuda"
        self.layouts = {s.name: weight_layout(s, "bfloat16") for s in [*specs, small]}
        biggest = max(self.layouts[s.name].total_bytes for s in specs)
        self.small_offset = -(-biggest // 4096) * 4096
        arena = self.small_offset + self.layouts[small.name].total_bytes
        max_ctx = max(*plan.contexts, plan.mixed[1], plan.prefill_len) + GREEDY_TOKENS + 8
        blocks = max(BATCHES) * -(-max_ctx // BLOCK_SIZE) + 8
        kv_bytes = max(s.kv_shape("bfloat16", BLOCK_SIZE).block_bytes for s in [*specs, small])
        self.num_blocks = blocks
        self.buffer = torch.empty(arena + blocks * kv_bytes + 4096, dtype=torch.uint8,
                                  device=self.device)
        self.kv_region = self.buffer[-(blocks * kv_bytes + 4096):]
        graph_kw: dict[str, Any] = {}
        if not self.on_cuda:  # the static step on the eager capturer (module docstring)
            from aegaeon_engine.cuda_graphs import EagerCapturer

            graph_kw = {"native": False, "capturer": EagerCapturer()}
        # one thread on a CPU (the dry run): a busy CI machine's second core is no help
        threads = None if self.on_cuda else 1
        self.graphs = Engine(self.device, num_threads=threads, graphs=True, **graph_kw)
        self.eager = Engine(self.device, num_threads=threads, graphs=False,
                            native=graph_kw.get("native", True))
        self.kv_bytes_per_token = {s.name: s.kv_shape("bfloat16", BLOCK_SIZE).block_bytes
                                   // BLOCK_SIZE for s in [*specs, small]}

    def weights(self, spec: Any, offset: int = 0) -> Any:
        return self.buffer[offset:offset + self.layouts[spec.name].total_bytes]

    def bind(self, spec: Any, offset: int = 0) -> None:
        for engine in (self.graphs, self.eager):
            engine.bind(spec, self.weights(spec, offset), self.kv_region, "bfloat16")

    def sync(self) -> None:
        if self.on_cuda:
            self.torch.cuda.synchronize(self.device)

    def seqs(self, contexts: Sequence[int]) -> list[Any]:
        from aegaeon_engine import DecodeSeq

        per = -(-(max(contexts) + 1) // BLOCK_SIZE)
        return [DecodeSeq(7, c, list(range(i * per, (i + 1) * per)))
                for i, c in enumerate(contexts)]

    def step_ms(self, engine: Any, contexts: Sequence[int], steps: int) -> float:
        """Median ms of a decode step of these contexts (after a warm-up step, which
        captures graphs where the engine replays them)."""
        seqs = self.seqs(contexts)
        return 1e3 * median_s(lambda: engine.decode(seqs), steps, self.sync)

    def prefill_tok_s(self, length: int) -> float:
        ids = [5 + i % 1000 for i in range(length)]
        blocks = list(range(-(-length // BLOCK_SIZE)))
        return length / median_s(lambda: self.graphs.prefill(ids, blocks), 3, self.sync)

    def greedy(self, engine: Any, lengths: Sequence[int]) -> list[list[int]]:
        from aegaeon_engine import DecodeSeq

        per = -(-(max(lengths) + GREEDY_TOKENS + 1) // BLOCK_SIZE)
        blocks = [list(range(i * per, (i + 1) * per)) for i in range(len(lengths))]
        prompts = [[3 + (7 * i + 11 * j) % 997 for j in range(n)] for i, n in enumerate(lengths)]
        outs = [[int(engine.prefill(p, b).argmax())] for p, b in zip(prompts, blocks,
                                                                     strict=True)]
        for _ in range(GREEDY_TOKENS - 1):
            seqs = [DecodeSeq(o[-1], len(p) + len(o) - 1, b)
                    for p, o, b in zip(prompts, outs, blocks, strict=True)]
            for o, t in zip(outs, engine.decode(seqs).argmax(-1).tolist(), strict=True):
                o.append(int(t))
        return outs

    def kernels(self) -> dict[str, list[str]]:
        """Attention kernels the profiler saw: an eager decode step (mixed batch of 8) and
        a prefill."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        seqs = self.seqs(self.plan.context_lists(8)[MIXED])
        out: dict[str, list[str]] = {}
        runs: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("decode", lambda: self.eager.decode(seqs)),
            ("prefill", lambda: self.eager.prefill(list(range(5, 261)), list(range(17)))))
        for name, run in runs:
            with profile(activities=activities) as prof:
                run()
                self.sync()
            names = {e.key for e in prof.key_averages()}
            out[name] = sorted(n for n in names if _is_attention(n))
        return out

    def roofline(self, spec: Any, contexts: Sequence[int], d2d_gb_s: float) -> dict[str, float]:
        layout = self.layouts[spec.name]
        embed = layout.slot("embed_tokens").nbytes
        weight = layout.total_bytes - (0 if spec.tie_word_embeddings else embed)
        kv = self.kv_bytes_per_token[spec.name] * sum(c + 1 for c in contexts)
        return {"weight_bytes": weight, "kv_bytes": kv,
                "roofline_ms": round(1e3 * (weight + kv) / (d2d_gb_s * 1e9), 4)}


def _is_attention(name: str) -> bool:
    lowered = name.lower()
    return any(k in lowered for k in ("attn", "attention", "flash", "fmha", "sdpa",
                                      "paged_decode", "_combine"))


def d2d_gb_s(device: Any, nbytes: int) -> float:
    """Device-to-device copy rate (bytes read plus written per second), median of 5."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def sync() -> None:
        if src.device.type == "cuda":
            torch.cuda.synchronize(src.device)

    sync()
    return 2 * nbytes / median_s(lambda: dst.copy_(src), 5, sync) / 1e9


def median_s(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn()`` up to ``sync()`` over ``repeats`` runs, after one untimed
    run (the warm-up)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_model(bench: Bench, spec: Any, d2d: float, small: Any,
                  small_before_ms: float | None) -> dict[str, Any]:
    """Everything of one big model (module docstring); ``small_before_ms``: the small
    model's step before any big model ran."""
    plan = bench.plan
    fill_random(spec, bench.layouts[spec.name], bench.weights(spec),
                seed=zlib.crc32(spec.name.encode()))
    bench.bind(spec)
    decode: dict[str, Any] = {}
    for batch in BATCHES:
        for shape, contexts in plan.context_lists(batch).items():
            eager = bench.step_ms(bench.eager, contexts, plan.steps)
            graphs = bench.step_ms(bench.graphs, contexts, plan.steps)
            roof = bench.roofline(spec, contexts, d2d)
            decode[f"b{batch}_{shape}"] = {
                "batch": batch, "context": shape, "eager_ms": round(eager, 4),
                "graphs_ms": round(graphs, 4), **roof,
                "roofline_share": round(roof["roofline_ms"] / graphs, 4),
                "over_roofline": round(graphs / roof["roofline_ms"], 4),
                "tok_s": round(batch * 1e3 / graphs, 2),
            }  # fmt: skip
    # the small model's step right after this one's
    bench.bind(small, bench.small_offset)
    after = bench.step_ms(bench.graphs, plan.context_lists(8)[MIXED], plan.steps)
    bench.bind(spec)
    prefill = bench.prefill_tok_s(plan.prefill_len)
    lengths = plan.context_lists(GREEDY_BATCH)[MIXED]
    lengths = [max(2, n // 8) for n in lengths]  # prompts, then 16 greedy tokens
    equal = bench.greedy(bench.eager, lengths) == bench.greedy(bench.graphs, lengths)
    return {
        "spec": spec.name, "weight_bytes": bench.layouts[spec.name].total_bytes,
        "decode": decode, "prefill_tok_s": round(prefill, 1), "greedy_equal": equal,
        "small_after": {"model": small.name, "after_ms": round(after, 4),
                        "alone_ms": small_before_ms,
                        "ratio": round(after / small_before_ms, 4) if small_before_ms else None},
        "graph_stats": bench.graphs.graph_stats.to_dict(),
    }  # fmt: skip


def wake_to_first_token(bench: Bench, spec: Any) -> dict[str, Any]:
    """The FP8 model copied from pinned host memory into the arena, bound, one decode step
    of a batch of 8 (its graphs were captured at this place before): no prefetch."""
    import torch
    from aegaeon_gpumem import copy_chunked

    nbytes = bench.layouts[spec.name].total_bytes
    host = bench.weights(spec).to("cpu")
    if bench.on_cuda:
        host = host.pin_memory()
    seqs = bench.seqs(bench.plan.context_lists(8)[MIXED])
    bench.bind(spec)
    bench.graphs.decode(seqs)  # graphs of this place exist before the wake, as a worker's
    bench.sync()
    start = time.perf_counter()
    copy_chunked(bench.weights(spec), host)
    copied = time.perf_counter()
    bench.graphs.bind(spec, bench.weights(spec), bench.kv_region, "bfloat16")
    bench.graphs.decode(seqs)
    bench.sync()
    end = time.perf_counter()
    del host
    if bench.on_cuda:
        torch.cuda.empty_cache()
    wake = end - start
    return {"bytes": nbytes, "copy_s": round(copied - start, 4),
            "first_step_s": round(end - copied, 4), "wake_to_first_token_s": round(wake, 4),
            "copy_gb_s": round(nbytes / max(copied - start, 1e-9) / 1e9, 2)}


def targets(models: dict[str, Any], fp8_wake: dict[str, Any] | None,
            peers: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's bounds (mixed contexts) and whether each held on this run."""
    rows: list[dict[str, Any]] = []

    def add(what: str, measured: float | None, bound: float, kind: str) -> None:
        met = None if measured is None else (measured <= bound if kind == "max"
                                             else measured >= bound)
        rows.append({"what": what, "measured": measured, "bound": bound, "kind": kind,
                     "met": met})

    for key, result in models.items():
        preset = key.rsplit("-", 1)[0]
        for batch in (1, 8):
            row = result["decode"].get(f"b{batch}_{MIXED}", {})
            if key.endswith("bfloat16") and preset in ROOFLINE_BOUNDS:
                add(f"{key} b{batch} mixed: step over roofline", row.get("over_roofline"),
                    ROOFLINE_BOUNDS[preset], "max")
        if key.endswith("fp8"):
            add(f"{key} b1 mixed: ms per step", result["decode"][f"b1_{MIXED}"]["graphs_ms"],
                FP8_B1_MS, "max")
        add(f"small model after {key}: over its step alone",
            result["small_after"]["ratio"], SMALL_AFTER_RATIO, "max")
        peer = peers.get(key) or {}
        for batch in BATCHES:
            ratio = (peer.get("ours_over_peer") or {}).get(f"b{batch}")
            add(f"{key} b{batch}: ours over transformers (decode tok/s)", ratio, 1.0, "min")
    if fp8_wake is not None:
        add("FP8 wake-to-first-token s (unprefetched)", fp8_wake["wake_to_first_token_s"],
            WAKE_S, "max")
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from aegaeon_bench.gpu_check.engine_peer import peer_results

    deadline = time.monotonic() + args.budget_s
    plan = Plan.of(args.tiny)
    specs = {f"{p}-{d}": model_spec(p, d, args.tiny) for p, d in BIG}
    small = model_spec(*SMALL, args.tiny)
    bench = Bench(args.device, plan, list(specs.values()), small)
    d2d = d2d_gb_s(bench.device, (1 << 30) if bench.on_cuda else (64 << 20))
    fill_random(small, bench.layouts[small.name], bench.weights(small, bench.small_offset), 1)
    bench.bind(small, bench.small_offset)
    small_alone = round(bench.step_ms(bench.graphs, plan.context_lists(8)[MIXED], plan.steps), 4)
    models: dict[str, Any] = {}
    wake = None
    kernels: dict[str, list[str]] = {}
    for key, spec in specs.items():
        if time.monotonic() > deadline:
            models[key] = {"skipped": "out of time"}
            continue
        models[key] = measure_model(bench, spec, d2d, small, small_alone)
        if not kernels:
            kernels = bench.kernels()
        if key.endswith("fp8"):
            wake = wake_to_first_token(bench, spec)
    del bench
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    measured = {k: v for k, v in models.items() if "decode" in v}
    peers = ({} if args.no_peer else
             peer_results(args.device, plan, specs, measured, deadline, compile_=not args.tiny
                          and not args.no_compile))
    return {
        "device": args.device, "device_name": (torch.cuda.get_device_name(args.device)
                                               if torch.cuda.is_available()
                                               and args.device.startswith("cuda") else None),
        "tiny": args.tiny, "torch": torch.__version__, "plan": plan.__dict__,
        "graphs": ("cuda graphs" if args.device.startswith("cuda")
                   else "eager capturer: the static step without a graph (cpu)"),
        "weights": "random, written on the device from the market presets' configs",
        "d2d_gb_s": round(d2d, 2), "models": models, "small_alone_ms": small_alone,
        "kernels": kernels, "fp8_wake": wake, "transformers": peers,
        "targets": targets(measured, wake, peers),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the dry run's plan (CPU)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="stop starting new measurements past this")
    parser.add_argument("--no-peer", action="store_true", help="leave transformers out")
    parser.add_argument("--no-compile", action="store_true",
                        help="transformers eager only (no torch.compile)")
    parser.add_argument("--json", action="store_true", help="the JSON object last (always)")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
