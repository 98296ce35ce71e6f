"""The serving step of ``scripts/gpu-check``: ``aegaeon serve`` under ``aegaeon bench serve``.

One prefill and one decode instance share one device (both ``device:
cuda:0`` on a GPU) over four models of the market, each worker's arena
holding two of them, so switches are real. ``aegaeon bench serve`` drives a
modest open-loop load (the sweep's ratios: prompts and outputs x 0.25, TTFT
2 s, TBT 25 ms), then ``aegaeon serve`` gets a Ctrl-C, and the step checks
that nothing outlived it: no process naming its run directory, no segment
of its deployment in /dev/shm, no GPU process of it in nvidia-smi.

Standard library only, like ``gpu_check.run``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aegaeon_bench.gpu_check.run import (
    Runner,
    StepResult,
    end_session,
    last_json_line,
    market_models,
    processes_mentioning,
    shm_segments,
    tail,
)
from aegaeon_bench.node.launch import bench_serve_argv, free_port

MiB = 1 << 20
STOP_TIMEOUT_S = 30.0
NUM_MODELS = 4
BYTES_PER_PARAM = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ServePlan:
    """What to serve and how hard to drive it."""

    device: str
    load_s: float  # seconds of arrivals
    grace_s: float  # after the last arrival, before open requests fail
    startup_s: float  # the most to wait for "Aegaeon is serving"
    rps: float = 0.5  # per model
    scale: float = 0.25  # prompt and output lengths x (ShareGPT-like)
    ttft_s: float = 2.0
    tbt_s: float = 0.025
    profile_s: float = 0.0  # py-spy each worker this long, from 10 s into the load (0: off)


def pick_models(market: Path, count: int = NUM_MODELS) -> list[dict[str, Any]]:
    """``count`` market entries spread over its sizes (smallest and largest included)."""
    entries = sorted(market_models(market), key=lambda e: int(e["params"]))
    if len(entries) <= count:
        return entries
    step = (len(entries) - 1) / (count - 1)
    return [entries[round(i * step)] for i in range(count)]


def serve_config(market: Path, run_dir: Path, port: int, plan: ServePlan) -> dict[str, Any]:
    """The deployment (JSON is YAML): both instances on the plan's device, arenas of two
    models, the SLO the load is scored by."""
    device = plan.device
    models = pick_models(market)
    largest = max(int(e["params"]) * BYTES_PER_PARAM.get(str(e["dtype"]), 2) for e in models)
    gpu = device.startswith("cuda")
    kv = (1024 if gpu else 192) * MiB
    instance = {"instances": 1, "device": device, "device_memory_bytes":
                2 * largest + 64 * MiB + kv, "kv_memory_bytes": kv}  # fmt: skip
    return {
        "models": [{"name": e["name"], "path": str(market / e["path"])} for e in models],
        "dtype": str(models[0]["dtype"]),
        "run_dir": str(run_dir),
        "slo": {"ttft_s": plan.ttft_s, "tbt_s": plan.tbt_s},
        "cachemgr": {"model_cache_bytes": (4096 if gpu else 1024) * MiB,
                     "kv_cache_bytes": (2048 if gpu else 512) * MiB},
        "prefill": instance,
        "decode": dict(instance),
        "proxy": {"host": "127.0.0.1", "port": port},
    }


def shm_prefix(run_dir: Path) -> str:
    """The deployment's segment prefix (``aegaeon_common.config.Config.shm_prefix``)."""
    return "aegaeon-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]


def gpu_processes() -> list[dict[str, str]] | None:
    """nvidia-smi's compute processes (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30, check=False)
    rows = [line.split(",") for line in out.stdout.strip().splitlines() if line.strip()]
    return [{"pid": r[0].strip(), "name": r[1].strip() if len(r) > 1 else "",
             "memory": r[2].strip() if len(r) > 2 else ""} for r in rows]  # fmt: skip


def service_errors(run_dir: Path, limit: int = 20) -> list[str]:
    """The last records at level error or above in the services' logs (JSON lines: the
    event and the end of its exception; other lines as they are)."""
    found: list[str] = []
    for path in sorted(run_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            entry = _error_entry(line)
            if entry is not None:
                found.append(f"{path.stem}: {entry}")
    return found[-limit:]


def _error_entry(line: str) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if isinstance(record, dict):
        if str(record.get("level", "")).lower() not in ("error", "critical"):
            return None
        detail = str(record.get("exception") or record.get("error") or "")
        return f"{record.get('event')}: {detail[-1500:]}"
    lowered = line.lower()
    if "traceback" in lowered or " error" in lowered or "[error" in lowered:
        return line[-600:]
    return None


def _wait_serving(proc: subprocess.Popen[bytes], out: Path, deadline: float) -> str | None:
    """None once serve announced itself, else why not."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"aegaeon serve exited {proc.returncode} while starting"
        if "Aegaeon is serving" in out.read_text(errors="replace"):
            return None
        time.sleep(0.25)
    return "aegaeon serve not ready in time"


def run_serve_step(runner: Runner, market: Path, work: Path, plan: ServePlan,
                   name: str = "serve") -> StepResult:
    """The whole step (module docstring) as step ``name`` (its logs and run dir named
    after it); its result is recorded in ``runner``."""
    return runner.call(name, lambda result: _serve(runner, market, work, plan, result, name))


@dataclass(frozen=True)
class Load:
    """One ``aegaeon bench serve`` run against a running node."""

    num_models: int
    rps: float  # per model
    load_s: float
    grace_s: float
    ttft_s: float
    tbt_s: float
    input_scale: float
    output_scale: float
    seed: int = 0

    @classmethod
    def of(cls, plan: ServePlan) -> Load:
        return cls(NUM_MODELS, plan.rps, plan.load_s, plan.grace_s, plan.ttft_s, plan.tbt_s,
                   plan.scale, plan.scale)  # fmt: skip


@dataclass
class Node:
    """One ``aegaeon serve`` of a step: started, driven one or more times, stopped and
    checked. ``res`` collects what the step reports of it."""

    runner: Runner
    name: str
    run_dir: Path
    url: str
    res: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    shm_before: frozenset[str] = frozenset()


def start_node(runner: Runner, work: Path, config: dict[str, Any], name: str,
               startup_s: float, serve_args: Sequence[str] = ()) -> tuple[Node, str | None]:
    """``aegaeon serve`` with ``config`` (its ``run_dir`` and proxy port set here) and
    ``serve_args`` as step ``name``'s node; the node and None once it serves, else why
    not (stop it either way)."""
    run_dir = (work / f"{name}-run").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {**config, "run_dir": str(run_dir),
              "proxy": {**(config.get("proxy") or {}), "host": "127.0.0.1", "port": port}}
    config_path = work / f"{name}-config.yaml"
    config_path.write_text(json.dumps(config, indent=1))
    node = Node(runner, name, run_dir, f"http://127.0.0.1:{port}",
                {"config": config, "url": f"http://127.0.0.1:{port}"},
                shm_before=frozenset(shm_segments()))  # fmt: skip
    out, err = runner.logs / f"{name}.out", runner.logs / f"{name}.err"
    argv = [sys.executable, "-m", "aegaeon_cli.main", "serve", "--config", str(config_path),
            "--run-dir", str(run_dir), *serve_args]  # fmt: skip
    start = time.monotonic()
    with out.open("wb") as fout, err.open("wb") as ferr:
        node.proc = subprocess.Popen(argv, stdout=fout, stderr=ferr, stdin=subprocess.DEVNULL,
                                     cwd=runner.cwd, env=dict(runner.env),
                                     start_new_session=True)  # fmt: skip
    problem = _wait_serving(node.proc, out, start + startup_s)
    node.res["startup_s"] = round(time.monotonic() - start, 2)
    if problem is not None:
        problem = f"{problem}\n{tail(err, 1500)}"
    return node, problem


def stop_node(node: Node) -> list[str]:
    """Ctrl-C the node and check that nothing outlived it; what was left behind."""
    res = node.res
    if node.proc is not None:
        _stop(node.proc, res)
    res["service_errors"] = service_errors(node.run_dir)
    res["leaked_processes"] = processes_mentioning(str(node.run_dir))
    res["leaked_shm"] = sorted(shm_segments(shm_prefix(node.run_dir)) - node.shm_before)
    res["gpu_processes_after"] = gpu_processes()
    shutil.copytree(node.run_dir, node.runner.logs / f"{node.name}-run", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.sock"))
    return [k for k in ("leaked_processes", "leaked_shm") if res[k]]


def judge_node(node: Node, result: StepResult, leaks: list[str]) -> None:
    """The step fails on what the node left behind or a bad exit on Ctrl-C; a failed
    step names the services' last errors."""
    res = node.res
    if result.status != "ok" and res["service_errors"]:
        result.error = f"{result.error}\nservice errors:\n" + "\n".join(res["service_errors"][-3:])
    if leaks and result.status == "ok":
        result.status, result.error = "failed", f"left behind: {', '.join(leaks)}"
    if result.status == "ok" and res.get("stop_returncode") not in (0, None):
        result.status = "failed"
        result.error = f"aegaeon serve exited {res['stop_returncode']} on Ctrl-C"


def _serve(runner: Runner, market: Path, work: Path, plan: ServePlan,
           result: StepResult, name: str) -> None:
    config = serve_config(market, work / f"{name}-run", 0, plan)
    result.logs = [f"{name}.out", f"{name}.err", f"{name}-bench.out", f"{name}-bench.err",
                   f"{name}-run/"]  # fmt: skip
    node, problem = start_node(runner, work, config, name, plan.startup_s)
    result.results = node.res
    try:
        if problem is not None:
            result.status, result.error = "failed", problem
        else:
            node.res["gpu_processes_serving"] = gpu_processes()
            profilers = start_profilers(runner, node.url, name, plan.profile_s)
            bench = drive(runner, market, node.url, Load.of(plan), name)
            node.res["profiles"] = finish_profilers(profilers)
            node.res.update(bench)
            if bench["bench_status"] != "ok":
                result.status = "failed"
                result.error = f"bench serve {bench['bench_status']}\n{bench['bench_error']}"
    finally:
        leaks = stop_node(node)
    judge_node(node, result, leaks)


def drive(runner: Runner, market: Path, url: str, load: Load, name: str,
          reserve_s: float = 40.0) -> dict[str, Any]:
    """``aegaeon bench serve`` against the running node, as ``name`` (its stdout, stderr
    and trace under the logs), ending ``reserve_s`` before the deadline at the latest (the
    node's stop and the leak checks); its status, JSON and the engine's ms per decode
    step."""
    trace = runner.logs / f"{name}-trace.jsonl"
    out, err = runner.logs / f"{name}-bench.out", runner.logs / f"{name}-bench.err"
    bench_s = max(min(load.load_s + load.grace_s + 60, runner.left_s() - reserve_s), 10.0)
    argv = bench_serve_argv(url, models=load.num_models, rps=f"{load.rps:.6g}",
                            duration=load.load_s, grace=load.grace_s,
                            input_scale=load.input_scale, output_scale=load.output_scale,
                            ttft=load.ttft_s, tbt=load.tbt_s, seed=load.seed, market=market,
                            trace=trace)  # fmt: skip
    status, code = runner.spawn(argv, out, err, bench_s)
    return {"bench_status": status, "bench_returncode": code, "bench": last_json_line(out),
            "bench_error": tail(err) if status != "ok" else None,
            "engine_ms_per_step": engine_ms_per_step(Path(f"{trace}.stats.json"))}


def start_mps(env: Mapping[str, str], work: Path) -> tuple[dict[str, str] | None, str]:
    """One CUDA MPS server for the processes started with the environment it returns
    (``env`` plus its pipe and log folders under ``work``); (None, why) when it did not
    start."""
    mps = {"CUDA_MPS_PIPE_DIRECTORY": str(work / "mps-pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(work / "mps-log")}  # fmt: skip
    for path in mps.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    out = {**env, **mps}
    started = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=out, timeout=30,
                             capture_output=True, text=True, check=False)  # fmt: skip
    if started.returncode != 0:
        return None, f"MPS did not start: {started.stderr.strip()}"
    return out, ""


def stop_mps(env: Mapping[str, str], work: Path, logs: Path) -> None:
    """Quit the MPS server of ``env`` (`start_mps`); its log joins the logs."""
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=dict(env), timeout=30,
                   capture_output=True, text=True, check=False)  # fmt: skip
    shutil.copytree(work / "mps-log", logs / "mps-log", dirs_exist_ok=True)


def _py_spy(runner: Runner) -> str | None:
    """py-spy from the carried wheels (``--target`` puts its binary under bin/), else PATH."""
    for entry in runner.env.get("PYTHONPATH", "").split(":"):
        candidate = Path(entry) / "bin" / "py-spy"
        if entry and candidate.is_file():
            return str(candidate)
    return shutil.which("py-spy")


def start_profilers(runner: Runner, url: str, name: str,
                    seconds: float) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    """One ``py-spy record`` (native frames, idle threads too, collapsed stacks) per worker,
    starting 10 s into the load; none when ``seconds`` is 0 or py-spy is missing."""
    from aegaeon_bench.node.http_client import fetch_sync

    spy = _py_spy(runner)
    if seconds <= 0 or spy is None:
        return []
    instances = fetch_sync("GET", url + "/health", timeout_s=10).json()["backend"]["instances"]
    started = []
    for inst, info in sorted(instances.items()):
        path = runner.logs / f"{name}-{inst}.pyspy.txt"
        argv = ["bash", "-c", f"sleep 10; exec {spy} record --pid {int(info['pid'])} "
                f"--duration {int(seconds)} --rate 100 --native --idle --format raw "
                f"--output {path}"]  # fmt: skip
        log = (runner.logs / f"{name}-{inst}.pyspy.err").open("wb")
        started.append((inst, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), path))
        log.close()
    return started


def finish_profilers(started: list[tuple[str, subprocess.Popen[bytes], Path]]) -> dict[str, Any]:
    """Wait for the profilers; each worker's profile file, or why there is none."""
    out: dict[str, Any] = {}
    for inst, proc, path in started:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out[inst] = path.name if path.is_file() else f"no profile (py-spy {proc.returncode})"
    return out


def engine_ms_per_step(stats_path: Path) -> dict[str, float] | None:
    """Median engine milliseconds per decode step of each instance's turns (the run's
    ``/v1/aegaeon/stats`` as ``bench serve`` saved it), None when it is missing."""
    import statistics

    try:
        turns = json.loads(stats_path.read_text())["turns"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    per: dict[str, list[float]] = {}
    for turn in turns:
        if turn.get("steps"):
            per.setdefault(str(turn["instance"]), []).append(
                1000 * float(turn["engine_s"]) / int(turn["steps"]))
    return {inst: round(statistics.median(v), 2) for inst, v in sorted(per.items())}


def _stop(proc: subprocess.Popen[bytes], res: dict[str, Any]) -> None:
    """Ctrl-C as a user would (the supervisor stops its children, cachemgr last)."""
    start = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res["stop_timed_out"] = True
    res["stop_s"] = round(time.monotonic() - start, 2)
    res["stop_returncode"] = proc.returncode
    end_session(proc, grace_s=5.0)
