"""``scripts/gpu-check --scenario paper``: the paper's comparison on one device in one run.

Steps (each recorded like the default check's, within ``--budget-s``):

1. ``paper_models`` (:mod:`aegaeon_bench.gpu_check.models`): read the machine,
   choose K real-shape presets (at most half the host RAM, 60% of the free
   disk, what /dev/shm and the build time allow, each fitting the device
   beside its KV region) and write them with random bf16 weights.
2. ``paper_aegaeon``: ``aegaeon serve`` with every model, one prefill and
   one decode instance sharing the device (under one CUDA MPS server when
   there is one), the artifact's SLO (TTFT 10 s, TPOT 100 ms) in its
   config. First a short capacity probe (``aegaeon bench serve`` at a low
   rate): the engine's measured seconds per decode step and per prompt token
   give the unit rate at which two instances serving one request at a time
   would be always busy (:func:`~aegaeon_bench.gpu_check.paper_stats.capacity_unit`);
   the rate ladder is that unit times :attr:`PaperPlan.multipliers`. Then
   open-loop ShareGPT-like loads (``bench serve``, the same seed at every
   rate), from the policy's start on the ladder (:data:`STARTS`: aegaeon at
   twice the unit, the baseline at half) up while attainment holds 90% and
   down while it does not, until the 90% crossing is bracketed (or the
   ladder, the run count or the time ends: the first policy takes at most
   half the runs the time holds); the node idles between runs.
3. ``paper_request-level``: the same node with the request-level baseline
   (every instance unified, requests bound to an instance), the same ladder.
4. ``paper_predict`` (:mod:`aegaeon_sim.gpu_predict`): the simulator,
   calibrated on the aegaeon node's measured costs (copy GB/s, per-model
   decode step and prefill times, switch and turn overheads), plays both
   policies at every rate of the ladder on the same requests.

The ``paper`` section of ``gpu-check.json``: the machine and the choice,
models per GPU, the capacity probe, attainment per policy and rate, the
sustainable rate at 90% per policy and their ratio (a bound when a crossing
was not bracketed), switches and their visible time, KV and Model Cache use,
and the prediction beside the measurement (``predicted``).
``--dry-run``: tiny
versions of the same presets on the CPU, lengths and TTFT scaled (the JSON
says how), a short load per rate.

Standard library only at the top, like the rest of gpu-check.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aegaeon_bench.gpu_check.paper_stats import (
    TARGET,
    capacity_unit,
    engine_costs,
    next_rate,
    rate_ratio,
    run_files,
    run_point,
    sustainable_rate,
)
from aegaeon_bench.gpu_check.run import Runner, StepResult, last_json_line
from aegaeon_bench.gpu_check.serve import (
    Load,
    Node,
    gpu_processes,
    judge_node,
    start_mps,
    start_node,
    stop_mps,
    stop_node,
)
from aegaeon_bench.gpu_check.serve import drive as drive_load

POLICIES = ("aegaeon", "request-level")
NUM_INSTANCES = 2  # one prefill + one decode, or two unified instances
# The workload's lognormal means (aegaeon_workload.synthetic.SHAREGPT_INPUT/OUTPUT; this
# process runs before the wheels it needs are installed, so it cannot import it).
SHAREGPT_MEAN_PROMPT = 699.0
SHAREGPT_MEAN_OUTPUT = 294.0
IDLE_WAIT_S = 30.0
STOP_RESERVE_S = 20.0  # a node's Ctrl-C and the checks after it
STATS_RECORDS = 20000
BUDGET_S = 290.0  # the five minutes, less the margin of the write-out
DRY_BUDGET_S = 240.0  # a guard: two nodes' starts dominate on a busy 2-core CPU


@dataclass(frozen=True)
class PaperPlan:
    """The scenario's knobs (one for a device, one for the dry run)."""

    device: str
    max_models: int
    build_budget_s: float  # the models' writing at the measured disk rate
    ttft_s: float
    tbt_s: float
    input_scale: float
    output_scale: float
    slo_note: str | None  # how the SLO and lengths differ from the paper's, and why
    probe_load_s: float
    probe_grace_s: float
    load_s: float
    grace_s: float
    startup_s: float
    multipliers: tuple[float, ...]
    # where each policy starts on the ladder (x the unit rate): near where the probe puts
    # its crossing (the baseline's instances busy half the time; aegaeon twice the unit)
    starts: tuple[tuple[str, float], ...]
    max_runs: int  # per policy
    fallback_unit_rps: float  # per model, when the probe measured nothing
    predict_s: float  # kept for the simulator's prediction at the end
    # a run lasts until this many arrivals are expected in all: at the ladder's low rates
    # ``load_s`` alone expects ~2, and a Poisson draw of none scores nothing (seen on the
    # H100: the baseline's one run drew 0 requests)
    min_requests: int = 6
    seed: int = 0

    def load_duration_s(self, num_models: int, rps: float) -> float:
        """A run's seconds of arrivals at ``rps`` per model."""
        return max(self.load_s, self.min_requests / (rps * num_models))

    def load(self, num_models: int, rps: float, probe: bool = False) -> Load:
        load_s = self.probe_load_s if probe else self.load_duration_s(num_models, rps)
        return Load(num_models, rps, load_s, self.probe_grace_s if probe else self.grace_s,
                    self.ttft_s, self.tbt_s, self.input_scale, self.output_scale,
                    self.seed)  # fmt: skip


LADDER = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# the baseline held 90% at 2x the unit on the H100 (2026-11-27): it starts at the unit
STARTS = (("aegaeon", 2.0), ("request-level", 1.0))


def gpu_plan(device: str, load_s: float) -> PaperPlan:
    """The artifact's SLO and ShareGPT's lengths as they are."""
    return PaperPlan(device, max_models=8, build_budget_s=60.0, ttft_s=10.0, tbt_s=0.1,
                     input_scale=1.0, output_scale=1.0, slo_note=None, probe_load_s=8.0,
                     probe_grace_s=12.0, load_s=load_s, grace_s=15.0, startup_s=150.0,
                     multipliers=LADDER, starts=STARTS, max_runs=4,
                     fallback_unit_rps=0.05, predict_s=20.0)  # fmt: skip


DRY_PLAN = PaperPlan(
    "cpu", max_models=4, build_budget_s=30.0, ttft_s=1.0, tbt_s=0.1, input_scale=0.25,
    output_scale=0.1,
    slo_note="dry run: tiny models on a CPU; prompts x0.25 and outputs x0.1 of ShareGPT's, "
    "TTFT scaled with the outputs (10 s x 0.1 = 1 s), TPOT the paper's 100 ms",
    probe_load_s=3.0, probe_grace_s=4.0, load_s=4.0, grace_s=6.0, startup_s=90.0,
    multipliers=LADDER, starts=STARTS, max_runs=2, fallback_unit_rps=0.5, predict_s=20.0,
)  # fmt: skip


def paper_config(market: Path, models: list[dict[str, Any]], layout: dict[str, Any],
                 plan: PaperPlan, policy: str) -> dict[str, Any]:
    """The deployment (JSON is YAML): every model, both instances on the plan's device with
    the layout's buffers, the SLO the runs are scored by, the policy."""
    instance = {"instances": 1, "device": plan.device,
                "device_memory_bytes": int(layout["device_memory_bytes"]),
                "kv_memory_bytes": int(layout["kv_memory_bytes"])}  # fmt: skip
    return {
        "models": [{"name": m["name"], "path": str(market / m["name"])} for m in models],
        "dtype": "bfloat16",
        "slo": {"ttft_s": plan.ttft_s, "tbt_s": plan.tbt_s},
        "scheduler": {"policy": policy},
        "cachemgr": {"model_cache_bytes": int(layout["model_cache_bytes"]),
                     "kv_cache_bytes": int(layout["host_kv_cache_bytes"])},
        "prefill": instance,
        "decode": dict(instance),
        "proxy": {"stats_records": STATS_RECORDS},
    }  # fmt: skip


def open_work(url: str) -> int | None:
    """Requests and sequences the node still holds (None when it does not answer). The
    node is gpu-check's own, with no API keys; ``$AEGAEON_API_KEY`` is sent when set, as
    every bench client does (its ``bench serve`` reads it too)."""
    from aegaeon_common.env import read_env

    from aegaeon_bench.node.client import auth_headers
    from aegaeon_bench.node.http_client import fetch_sync

    try:
        reply = fetch_sync("GET", f"{url}/v1/aegaeon/stats?light=1",
                           headers=auth_headers(read_env().api_key), timeout_s=10)  # fmt: skip
        stats = reply.json() if reply.status == 200 else None
    except (OSError, ValueError):
        return None
    if not isinstance(stats, dict):
        return None
    held = sum(int(i.get("open_sequences") or 0) for i in stats.get("instances") or []
               if isinstance(i, dict))  # fmt: skip
    return int(stats.get("open_requests") or 0) + held


def wait_idle(url: str, timeout_s: float) -> float:
    """Wait until the node holds nothing (a cancelled run's requests are let go); seconds
    waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if open_work(url) in (0, None):
            break
        time.sleep(0.5)
    return round(time.monotonic() - start, 2)


class PaperScenario:
    """One run of the scenario (module docstring) on gpu-check's runner (its logs folder
    and deadline); ``work`` holds the market and the nodes' run directories."""

    def __init__(self, runner: Runner, work: Path, market: Path, plan: PaperPlan,
                 tiny: bool, policies: tuple[str, ...] = POLICIES) -> None:
        self.runner = runner
        self.policies = policies
        self.tiny = tiny
        self.plan = plan
        self.work = work
        self.market = market
        self.models: list[dict[str, Any]] = []
        self.layout: dict[str, Any] = {}
        self.built: dict[str, Any] = {}
        self.capacity: dict[str, Any] = {}
        self.ladder: list[float] = []
        self.runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        self.startup_s: list[float] = []
        self.stop_s: list[float] = []
        self.mps = False
        self.mps_note = ""
        self.predicted: dict[str, Any] | None = None

    # ---- steps ---------------------------------------------------------------------
    def run(self) -> None:
        if not self.build_models():
            for policy in self.policies:
                self.runner.skip(f"paper_{policy}", "no models")
            return
        env, mps_why = self.mps_env()
        saved = self.runner.env
        if env is not None:
            self.runner.env, self.mps = env, True
        try:
            for policy in self.policies:
                self.runner.call(f"paper_{policy}", functools.partial(self.serve_policy, policy))
        finally:
            self.runner.env = saved
            if env is not None:
                stop_mps(env, self.work, self.runner.logs)
        self.mps_note = mps_why
        self.predict()

    def build_models(self) -> bool:
        plan = self.plan
        argv = [sys.executable, "-m", "aegaeon_bench.gpu_check.models", "--market",
                str(self.market), "--device", plan.device, "--max-models", str(plan.max_models),
                "--budget-s", str(plan.build_budget_s), "--json",
                *(("--tiny",) if self.tiny else ())]  # fmt: skip
        # nothing runs without the models: their cap is theirs, what is left the runs'
        result = self.runner.command("paper_models", argv, plan.build_budget_s * 2 + 60,
                                     parse=lambda out, _err: last_json_line(out))  # fmt: skip
        built = result.results or {}
        self.built = built
        self.models = list(built.get("models") or [])
        self.layout = built.get("layout") or {}
        return result.status == "ok" and bool(self.models)

    def mps_env(self) -> tuple[dict[str, str] | None, str]:
        if not self.plan.device.startswith("cuda"):
            return None, "no device"
        if shutil.which("nvidia-cuda-mps-control") is None:
            return None, "no nvidia-cuda-mps-control"
        return start_mps(self.runner.env, self.work)

    # ---- time: estimates from what already ran, else the plan's worst cases ----------
    def run_estimate_s(self, rate: float | None = None) -> float:
        """The longest run so far, or the plan's worst case; at least what a run at
        ``rate`` lasts (a low rate loads longer: ``PaperPlan.load_duration_s``)."""
        plan = self.plan
        measured = [r["run_s"] for runs in self.runs.values() for r in runs]
        estimate = max(measured, default=plan.load_s + plan.grace_s + 5.0)
        if rate is None:
            return estimate
        return max(estimate, plan.load_duration_s(len(self.models), rate) + plan.grace_s + 5.0)

    def stop_estimate_s(self) -> float:
        return max(self.stop_s, default=STOP_RESERVE_S)

    def node_estimate_s(self) -> float:
        """A later node's start, its probe when none ran, and its stop."""
        plan = self.plan
        probe = 0.0 if self.ladder else plan.probe_load_s + plan.probe_grace_s + 5.0
        start = max(self.startup_s, default=plan.startup_s / 3)
        return start + probe + self.stop_estimate_s()

    def runs_affordable(self, later: int, rate: float | None = None) -> int:
        """Runs (at ``rate``, when given) the time left holds, this node's stop, the later
        nodes and the prediction kept aside."""
        fixed = self.stop_estimate_s() + later * self.node_estimate_s() + self.plan.predict_s
        return max(int((self.runner.left_s() - fixed) // self.run_estimate_s(rate)), 0)

    def serve_policy(self, policy: str, result: StepResult) -> None:
        plan = self.plan
        name = f"paper_{policy}"
        config = paper_config(self.market, self.models, self.layout, plan, policy)
        result.logs = [f"{name}.out", f"{name}.err", f"{name}-run/"]
        node, problem = start_node(self.runner, self.work, config, name, plan.startup_s)
        result.results = node.res
        self.startup_s.append(float(node.res.get("startup_s") or 0.0))
        try:
            if problem is not None:
                result.status, result.error = "failed", problem
            else:
                node.res["gpu_processes_serving"] = gpu_processes()
                self.load_ladder(node, policy, result)
        finally:
            leaks = stop_node(node)
            self.stop_s.append(float(node.res.get("stop_s") or 0.0))
        judge_node(node, result, leaks)
        node.res.pop("config", None)  # the logs keep it (RUN_DIR/config.yaml)

    def load_ladder(self, node: Node, policy: str, result: StepResult) -> None:
        """The policy's runs up the ladder (module docstring). Each policy but the last
        takes at most its share of the runs the time holds (at least one), keeping a
        start, a run and a stop for each later one."""
        plan = self.plan
        if not self.ladder:
            self.probe(node)
        later = len(self.policies) - 1 - self.policies.index(policy)
        share = -(-self.runs_affordable(later) // (later + 1)) if later else plan.max_runs
        allowed = min(plan.max_runs, max(share, 1))
        node.res["runs_allowed"] = allowed
        tried: dict[float, float | None] = {}
        start = self.ladder[plan.multipliers.index(dict(plan.starts)[policy])]
        while len(tried) < allowed:
            rate = next_rate(tried, self.ladder, start)
            if rate is None:
                break
            if self.runs_affordable(later, rate) < 1 + later:
                node.res["stopped_early"] = (f"{self.runner.left_s():.0f} s left: no run "
                                             "beside the later policies'")  # fmt: skip
                break
            point = self.load_once(node, policy, rate, f"{result.name}-r{len(tried)}")
            tried[rate] = point["slo_attainment"]
            if point.get("bench_status") != "ok":
                result.status = "failed"
                result.error = f"bench serve {point.get('bench_status')} at {rate:.4g} RPS " \
                               f"per model\n{point.get('bench_error') or ''}"
                break

    def probe(self, node: Node) -> None:
        """The capacity probe (module docstring): the ladder from its measured costs."""
        plan, k = self.plan, len(self.models)
        rate = 2.0 / plan.probe_load_s  # about two requests per model
        out = drive_load(self.runner, self.market, node.url, plan.load(k, rate, probe=True),
                         "paper_probe", STOP_RESERVE_S)  # fmt: skip
        files = run_files(self.runner.logs / "paper_probe-trace.jsonl")
        costs = engine_costs(files)
        mean_prompt = SHAREGPT_MEAN_PROMPT * plan.input_scale
        mean_output = SHAREGPT_MEAN_OUTPUT * plan.output_scale
        unit = capacity_unit(costs, mean_prompt, mean_output, k, NUM_INSTANCES)
        self.capacity = {
            "probe_rps_per_model": rate, "probe_status": out["bench_status"],
            "probe_requests": (out.get("bench") or {}).get("requests"),
            "costs": costs, "mean_prompt_tokens": mean_prompt,
            "mean_output_tokens": mean_output, "num_instances": NUM_INSTANCES,
            "unit_rps_per_model": unit, "estimated": unit is not None,
            "idle_wait_s": wait_idle(node.url, IDLE_WAIT_S),
        }  # fmt: skip
        if unit is None:
            unit = plan.fallback_unit_rps
            self.capacity["reason"] = "the probe measured no decode step: the plan's guess"
        self.ladder = [unit * m for m in plan.multipliers]

    def load_once(self, node: Node, policy: str, rate: float, name: str) -> dict[str, Any]:
        plan, k = self.plan, len(self.models)
        started = time.monotonic()
        out = drive_load(self.runner, self.market, node.url, plan.load(k, rate), name,
                         STOP_RESERVE_S)
        files = run_files(self.runner.logs / f"{name}-trace.jsonl")
        model_bytes = {m["name"]: int(m["bytes"]) for m in self.models}
        point = {
            "policy": policy, "rps_per_model": rate, "total_rps": rate * k,
            "multiplier": plan.multipliers[self.ladder.index(rate)],
            **run_point(out.get("bench"), files, model_bytes, NUM_INSTANCES,
                        int(self.layout.get("kv_memory_bytes") or 0)),
            "bench_status": out["bench_status"], "bench_error": out.get("bench_error"),
            "trace": f"{name}-trace.jsonl",
        }  # fmt: skip
        point["idle_wait_s"] = wait_idle(node.url, IDLE_WAIT_S)
        point["run_s"] = round(time.monotonic() - started, 2)
        self.runs[policy].append(point)
        attainment = point["slo_attainment"]
        self.runner.say(f"gpu-check: {policy} at {rate:.4g} RPS per model ({rate * k:.3g} in "
                        f"all): attainment "
                        f"{'-' if attainment is None else f'{attainment:.1%}'} of "
                        f"{point.get('requests')} requests")  # fmt: skip
        return point

    def predict(self) -> None:
        """``aegaeon_sim.gpu_predict``: the simulator calibrated on the aegaeon node (its
        last run's stats hold every switch, turn and request timing of the node; its
        profiles the copy rate), both policies at every rate of the ladder."""
        node = next((p for p in POLICIES if self.runs[p]), None)
        if node is None:
            self.runner.skip("paper_predict", "no run to calibrate the simulator on")
            return
        inputs = self.work / "paper-predict.json"
        inputs.write_text(json.dumps({
            "logs": str(self.runner.logs), "calibration_trace": self.runs[node][-1]["trace"],
            "calibration_config": f"paper_{node}-run/config.yaml", "plan": asdict(self.plan),
            "ladder": self.ladder, "policies": list(self.policies),
            "runs": {p: [{"rps_per_model": r["rps_per_model"],
                          "slo_attainment": r["slo_attainment"]} for r in runs]
                     for p, runs in self.runs.items()},
        }))  # fmt: skip
        argv = [sys.executable, "-m", "aegaeon_sim.gpu_predict", str(inputs), "--json"]
        result = self.runner.command("paper_predict", argv, 4 * self.plan.predict_s,
                                     parse=lambda out, _err: last_json_line(out))
        self.predicted = result.results

    # ---- the JSON section ----------------------------------------------------------
    def section(self) -> dict[str, Any]:
        plan = self.plan
        sustainable = {p: sustainable_rate([(r["rps_per_model"], r["slo_attainment"])
                                            for r in runs if r["slo_attainment"] is not None])
                       for p, runs in self.runs.items()}  # fmt: skip
        ratio = rate_ratio(sustainable["aegaeon"], sustainable["request-level"])
        choice = self.built.get("choice") or {}
        return {
            "plan": asdict(plan), "target_attainment": TARGET,
            "slo": {"ttft_s": plan.ttft_s, "tbt_s": plan.tbt_s, "scaled": plan.slo_note},
            "machine": self.built.get("machine"), "gpu": self.built.get("gpu"),
            "models": [{k: m.get(k) for k in ("name", "preset", "bytes", "write_s")}
                       for m in self.models],
            "models_per_gpu": len(self.models),
            "model_bytes_total": sum(int(m["bytes"]) for m in self.models),
            "choice": {k: choice.get(k) for k in ("caps", "binding", "cap_bytes",
                                                  "gpu_model_cap_bytes", "downgrades",
                                                  "dropped")},
            "build_s": self.built.get("build_s"), "written_gb_s": self.built.get("written_gb_s"),
            "instances": {"prefill": 1, "decode": 1, "device": plan.device, "mps": self.mps,
                          "mps_note": self.mps_note},
            "layout": self.layout, "startup_s": self.startup_s,
            "capacity": self.capacity, "ladder_rps_per_model": self.ladder,
            "attainment": {p: {f"{r['rps_per_model']:.4g}": r["slo_attainment"] for r in runs}
                           for p, runs in self.runs.items()},
            "sustainable": sustainable, "ratio": ratio,
            "switches": {p: totals(runs) for p, runs in self.runs.items()},
            "runs": self.runs,
            "predicted": self.predicted,
        }  # fmt: skip


def totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A policy's switches over its runs, and the most KV and Model Cache it used."""
    switches = [r["switch"] for r in runs if r.get("switch")]
    memory = [r["memory"] for r in runs if r.get("memory")]
    shares = [m["device_kv_peak_share"] for m in memory if m.get("device_kv_peak_share")]
    cache = [m["model_cache"] for m in memory if m.get("model_cache")]
    return {
        "switches": sum(int(r.get("switches") or 0) for r in runs),
        "records": sum(s["records"] for s in switches),
        "prefetched": sum(s["prefetched"] for s in switches),
        "visible_s": round(sum(s["visible_s"] for s in switches), 4),
        "visible_share_max": max((s["visible_share"] for s in switches), default=None),
        "copy_gb_s": [s["copy_gb_s"] for s in switches if s.get("copy_gb_s")],
        "device_kv_peak_share": max(shares, default=None),
        "host_kv_peak_bytes": max((m.get("host_kv_peak_bytes") or 0 for m in memory),
                                  default=None),
        "model_cache_used_bytes": max((c.get("used_bytes") or 0 for c in cache), default=None),
        "model_cache_budget_bytes": next((c.get("budget_bytes") for c in cache), None),
        "model_cache_evictions": max((c.get("evictions") or 0 for c in cache), default=None),
    }


def run_paper(runner: Runner, work: Path, market: Path, dry: bool, device: str,
              load_s: float, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """The scenario's steps on ``runner`` (``DRY_PLAN`` on the CPU with tiny models, else
    on ``device``); its ``paper`` section."""
    plan = DRY_PLAN if dry else gpu_plan(device if ":" in device else f"{device}:0", load_s)
    scenario = PaperScenario(runner, work, market, plan, tiny=dry, policies=policies)
    scenario.run()
    return scenario.section()
