"""``scripts/gpu-check --scenario paper``: every policy of the paper's comparison on one device.

One machine, one yardstick (issue 38). Steps, each recorded like the default
check's, within ``--budget-s``:

1. ``paper_models`` (:mod:`aegaeon_bench.gpu_check.models`): read the machine
   and add K models to a market as in-memory entries (on a GPU eight 7-8B
   presets in FP8; on a CPU the same presets shrunk): no weight file; each node's
   Model Cache generates their seeded weights at load.
2. A node per run of one policy (``paper_<policy>``, ``-2``... when a policy's
   node starts again): ``aegaeon serve --policy P --device-memory CAP`` with
   every model, one prefill and one decode instance (two unified ones for the
   baselines) sharing the device, each capped so that its arena holds two of
   the largest model beside its KV region (the paper's memory pressure: at most
   two 8B models per instance); the baseline's load path in ``baseline``.
3. On the first node, once: a capacity probe (``bench serve`` at a low rate:
   the engine's measured seconds per decode step and per prompt token give the
   unit rate, :func:`~aegaeon_bench.gpu_check.paper_stats.capacity_unit`), then
   ``paper_plan``: the simulator calibrated on the probe predicts every policy
   on one rate grid, and :mod:`~aegaeon_bench.gpu_check.paper_plan` picks the
   two (or three) grid rates around each policy's predicted 90% crossing,
   orders every run rate by rate (the node that is up goes on) and fits the
   plan to the time left (what does not fit is said).
4. The runs: open-loop ShareGPT-like loads (``bench serve``, the same seed at
   every rate, so policies at one rate get the same requests), at least
   ``load_s`` of arrivals (longer at a low rate, until ``min_requests`` are
   expected) and ``grace_s`` after; the node idles between runs. After a
   policy's planned runs, one more grid rate while its measured crossing is not
   bracketed (:func:`~aegaeon_bench.gpu_check.paper_plan.extend`).
5. ``paper_predict`` (:mod:`aegaeon_sim.gpu_predict`): the simulator calibrated
   on each policy's own node (its last run: its switches, steps and prefills)
   predicts every point it measured, printed beside it.

The ``paper`` section of ``gpu-check.json``: the machine and the choice, the
cap, the plan and why, attainment per policy and rate, the sustainable rate at
90% per policy and aegaeon's ratio to each, what a switch cost each policy
(measured), models per GPU at the paper's 0.1 RPS, KV and Model Cache use, and
the prediction beside the measurement. Three plans: a GPU's (the paper's SLO
and lengths), ``--device cpu`` (the CPU-scale scenario: small models, the SLO
scaled, the baseline's load path scaled to this CPU's copy rate) and the dry
run (tiny models, seconds of load).

Standard library only at the top, like the rest of gpu-check.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from aegaeon_bench.gpu_check.paper_plan import (
    TARGET,
    Fitted,
    PolicyRates,
    choose_rates,
    extend,
    fit_budget,
    node_starts,
    rate_grid,
)
from aegaeon_bench.gpu_check.paper_stats import (
    capacity_unit,
    engine_costs,
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

# every policy, in priority order (what a short budget keeps first)
POLICIES = ("aegaeon", "request-level-charged", "request-level", "static-mux")
NUM_INSTANCES = 2  # one prefill + one decode, or two unified instances
GiB = 1 << 30
# The workload's lognormal means (aegaeon_workload.synthetic.SHAREGPT_INPUT/OUTPUT; this
# process runs before the wheels it needs are installed, so it cannot import it).
SHAREGPT_MEAN_PROMPT = 699.0
SHAREGPT_MEAN_OUTPUT = 294.0
PAPER_RPS_PER_MODEL = 0.1  # Fig. 11a: models per GPU are counted at this rate
IDLE_WAIT_S = 30.0
IDLE_ESTIMATE_S = 5.0  # a run's idle wait, before any was measured
HELD_DRAIN_S = 10.0  # after the last arrival, a run predicted to hold 90% (its grace: more)
STOP_RESERVE_S = 20.0  # a node's Ctrl-C and the checks after it
STATS_RECORDS = 20000
BUDGET_S = 570.0  # the 9.5 minutes on one H100
CPU_BUDGET_S = 3600.0
DRY_BUDGET_S = 480.0  # a guard: five nodes' starts dominate on a busy 2-core CPU


@dataclass(frozen=True)
class PaperPlan:
    """The scenario's knobs (one for a GPU, one for the CPU-scale run, one for the dry run)."""

    device: str
    scale: str  # models: full | small | tiny (aegaeon_bench.gpu_check.models)
    max_models: int
    build_budget_s: float  # a node start's generation of the models, at the measured rate
    ttft_s: float
    tbt_s: float
    input_scale: float
    output_scale: float
    slo_note: str | None  # how the SLO and lengths differ from the paper's, and why
    probe_load_s: float
    probe_grace_s: float
    load_s: float  # at least this many seconds of arrivals per run
    grace_s: float
    min_requests: int  # a run lasts until this many arrivals are expected in all
    startup_s: float  # the most a node start may take
    points: int  # rates per policy from the prediction (2 or 3; 1 in the dry run)
    max_points: int  # with the extensions that bracket a measured crossing
    fallback_unit_rps: float  # per model, when the probe measured nothing
    predict_s: float  # kept for the simulator's prediction at the end
    grid_low: float = 0.125  # the rate grid: unit x low .. high by step
    grid_high: float = 8.0
    grid_step: float = 2**0.5
    seed: int = 0

    def load_duration_s(self, num_models: int, rps: float) -> float:
        """A run's seconds of arrivals at ``rps`` per model."""
        return max(self.load_s, self.min_requests / (rps * num_models))

    def load(self, num_models: int, rps: float, probe: bool = False) -> Load:
        load_s = self.probe_load_s if probe else self.load_duration_s(num_models, rps)
        return Load(num_models, rps, load_s, self.probe_grace_s if probe else self.grace_s,
                    self.ttft_s, self.tbt_s, self.input_scale, self.output_scale,
                    self.seed)  # fmt: skip

    def run_estimate_s(self, num_models: int, rps: float, holds: bool = False) -> float:
        """A run's arrivals, the idle wait, and the whole grace, or (``holds``: predicted
        to hold 90%, its requests done soon after the last arrival) a part of it."""
        grace = min(self.grace_s, HELD_DRAIN_S) if holds else self.grace_s
        return self.load_duration_s(num_models, rps) + grace + IDLE_ESTIMATE_S


def gpu_plan(device: str) -> PaperPlan:
    """The artifact's SLO and ShareGPT's lengths as they are; 60 s + 30 s per point."""
    return PaperPlan(device, scale="full", max_models=8, build_budget_s=60.0, ttft_s=10.0,
                     tbt_s=0.1, input_scale=1.0, output_scale=1.0, slo_note=None,
                     probe_load_s=10.0, probe_grace_s=15.0, load_s=60.0, grace_s=30.0,
                     min_requests=30, startup_s=150.0, points=2, max_points=3,
                     fallback_unit_rps=0.05, predict_s=40.0)  # fmt: skip


CPU_PLAN = PaperPlan(
    "cpu", scale="small", max_models=8, build_budget_s=30.0, ttft_s=2.0, tbt_s=0.2,
    input_scale=0.25, output_scale=0.1,
    slo_note="CPU-scale: small models (the presets shrunk to 4 layers of width 256) on a CPU; "
    "prompts x0.25 and outputs x0.1 of ShareGPT's, TTFT 2 s and TPOT 200 ms (a CPU decode "
    "step of these models takes tens of ms under load); the baseline's load path is this "
    "CPU's copy rate x 16/52.2 (the artifact's 16 GB/s against an H100's measured link)",
    probe_load_s=10.0, probe_grace_s=15.0, load_s=60.0, grace_s=30.0, min_requests=30,
    startup_s=240.0, points=2, max_points=3, fallback_unit_rps=0.2, predict_s=120.0,
)  # fmt: skip

DRY_PLAN = PaperPlan(
    "cpu", scale="tiny", max_models=4, build_budget_s=30.0, ttft_s=1.0, tbt_s=0.1,
    input_scale=0.25, output_scale=0.1,
    slo_note="dry run: tiny models on a CPU; prompts x0.25 and outputs x0.1 of ShareGPT's, "
    "TTFT scaled with the outputs (10 s x 0.1 = 1 s), TPOT the paper's 100 ms; seconds of "
    "load per point at one rate, every policy's (the real runs hold 60 s and 30 requests "
    "at the rates around each one's crossing)",
    probe_load_s=1.0, probe_grace_s=4.0, load_s=4.0, grace_s=6.0, min_requests=6,
    startup_s=120.0, points=1, max_points=1, fallback_unit_rps=0.5, predict_s=60.0,
    # a grid of one rate, the probe's unit: every policy runs it, so each node starts once
    # (no policy's node comes back for a higher rate) and a run is a few requests
    grid_low=1.0, grid_high=1.0,
)  # fmt: skip


def paper_config(market: Path, models: list[dict[str, Any]], layout: dict[str, Any],
                 plan: PaperPlan, policy: str, load_gb_s: float) -> dict[str, Any]:
    """The deployment (JSON is YAML): every model, both instances on the plan's device
    (their device memory comes from ``--device-memory``), the SLO the runs are scored
    by, the policy and the baseline's load path."""
    instance = {"instances": 1, "device": plan.device}
    return {
        "models": [{"name": m["name"], "path": str(market / m["name"])} for m in models],
        "slo": {"ttft_s": plan.ttft_s, "tbt_s": plan.tbt_s},
        "scheduler": {"policy": policy},
        "baseline": {"load_gb_s": load_gb_s, "init_s": 0.0},
        "cachemgr": {"model_cache_bytes": int(layout["model_cache_bytes"]),
                     "kv_cache_bytes": int(layout["host_kv_cache_bytes"])},
        "prefill": instance,
        "decode": dict(instance),
        "proxy": {"stats_records": STATS_RECORDS},
    }  # fmt: skip


def _stats(url: str) -> dict[str, Any] | None:
    """The node's light stats (None when it does not answer). The node is gpu-check's
    own, with no API keys; ``$AEGAEON_API_KEY`` is sent when set, as every bench client
    does (its ``bench serve`` reads it too)."""
    from aegaeon_common.env import read_env

    from aegaeon_bench.node.client import auth_headers
    from aegaeon_bench.node.http_client import fetch_sync

    try:
        reply = fetch_sync("GET", f"{url}/v1/aegaeon/stats?light=1",
                           headers=auth_headers(read_env().api_key), timeout_s=10)  # fmt: skip
        stats = reply.json() if reply.status == 200 else None
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) else None


def open_work(url: str) -> int | None:
    """Requests and sequences the node still holds (None when it does not answer)."""
    stats = _stats(url)
    if stats is None:
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
                 policies: tuple[str, ...] = POLICIES) -> None:
        self.runner = runner
        self.policies = policies
        self.plan = plan
        self.work = work
        self.market = market
        self.models: list[dict[str, Any]] = []
        self.layout: dict[str, Any] = {}
        self.built: dict[str, Any] = {}
        self.capacity: dict[str, Any] = {}
        self.grid: list[float] = []
        self.curves: dict[str, list[tuple[float, float]]] = {}
        self.chosen: list[PolicyRates] = []
        self.fitted: Fitted | None = None
        self.plan_note = ""
        self.pending: list[tuple[str, float]] = []  # the order, what is left of it
        self.skipped: list[dict[str, Any]] = []  # runs the time did not hold
        self.extensions: list[dict[str, Any]] = []
        self.runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        self.sessions: list[dict[str, Any]] = []  # every node: policy, name, times
        self.mps = False
        self.mps_note = ""
        self.predicted: dict[str, Any] | None = None
        self.planned: dict[str, Any] | None = None

    @property
    def num_models(self) -> int:
        return len(self.models)

    @property
    def load_gb_s(self) -> float:
        return float(self.built.get("load_gb_s") or 16.0)

    # ---- steps ---------------------------------------------------------------------
    def run(self) -> None:
        if not self.build_models():
            self.runner.skip(f"paper_{self.policies[0]}", "no models")
            return
        env, mps_why = self.mps_env()
        saved = self.runner.env
        if env is not None:
            self.runner.env, self.mps = env, True
        try:
            self.session(self.policies[0], first=True)
            while self.pending:
                self.session(self.pending[0][0])
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
                "--budget-s", str(plan.build_budget_s), "--scale", plan.scale,
                "--json"]  # fmt: skip
        result = self.runner.command("paper_models", argv, 300.0,
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

    # ---- time ---------------------------------------------------------------------
    def start_estimate_s(self) -> float:
        """A node's start and stop: the slowest measured, else the plan's guess."""
        starts = [float(s.get("startup_s") or 0.0) for s in self.sessions]
        stops = [float(s.get("stop_s") or 0.0) for s in self.sessions if s.get("stop_s")]
        return max(starts, default=self.plan.startup_s / 3) + max(stops, default=STOP_RESERVE_S)

    def run_s(self, policy: str, rate: float) -> float:
        """A run's expected seconds: its grace in full unless the prediction says it holds
        (then a late run that misses may leave a later one no time: it is skipped, said)."""
        predicted = dict(self.curves.get(policy) or []).get(rate)
        holds = predicted is not None and predicted >= TARGET
        return self.plan.run_estimate_s(self.num_models, rate, holds)

    def affordable(self, policy: str, rate: float) -> bool:
        """A run at ``rate`` fits beside this node's stop, the later nodes and the
        prediction at the end."""
        plan = self.plan
        keep = (max((float(s.get("stop_s") or 0) for s in self.sessions), default=STOP_RESERVE_S)
                + node_starts(self.pending, policy) * self.start_estimate_s() + plan.predict_s)
        return self.runner.left_s() - keep >= self.run_s(policy, rate)

    # ---- a node -------------------------------------------------------------------
    def session(self, policy: str, first: bool = False) -> None:
        count = sum(1 for s in self.sessions if s["policy"] == policy)
        name = f"paper_{policy}" + (f"-{count + 1}" if count else "")
        self.runner.call(name, lambda result: self.serve(policy, name, result, first))
        if not first and self.pending and self.pending[0][0] == policy:
            # the node failed before its runs: what it was to run is dropped, not retried
            while self.pending and self.pending[0][0] == policy:
                self.skip(*self.pending.pop(0), why=f"{name} failed")

    def skip(self, policy: str, rate: float, why: str) -> None:
        self.skipped.append({"policy": policy, "rps_per_model": rate, "why": why})

    def serve(self, policy: str, name: str, result: StepResult, first: bool) -> None:
        plan = self.plan
        config = paper_config(self.market, self.models, self.layout, plan, policy,
                              self.load_gb_s)  # fmt: skip
        cap = int(self.layout["device_memory_bytes"])
        result.logs = [f"{name}.out", f"{name}.err", f"{name}-run/"]
        node, problem = start_node(self.runner, self.work, config, name, plan.startup_s,
                                   serve_args=("--device-memory", f"{cap / GiB:.6f}"))
        result.results = node.res
        session = {"policy": policy, "name": name, "startup_s": node.res.get("startup_s")}
        self.sessions.append(session)
        try:
            if problem is not None:
                result.status, result.error = "failed", problem
            else:
                node.res["gpu_processes_serving"] = gpu_processes()
                node.res["model_cache_generation"] = generation(node.url)
                if first:
                    self.probe(node)
                    self.make_plan(policy)
                self.run_segment(node, policy, name, result)
        finally:
            leaks = stop_node(node)
            session["stop_s"] = node.res.get("stop_s")
        judge_node(node, result, leaks)
        node.res.pop("config", None)  # the logs keep it (RUN_DIR/config.yaml)

    def run_segment(self, node: Node, policy: str, name: str, result: StepResult) -> None:
        """This node's runs: the order's while it names this policy, then (when the order
        has no more of it) the extensions that bracket its measured crossing."""
        while self.pending and self.pending[0][0] == policy:
            _, rate = self.pending.pop(0)
            if not self.affordable(policy, rate):
                self.skip(policy, rate, f"no time: {self.runner.left_s():.0f} s left")
                continue
            if not self.load_once(node, policy, rate, name, result):
                return
        if any(p == policy for p, _ in self.pending):
            return
        while True:
            tried = {r["rps_per_model"]: r["slo_attainment"] for r in self.runs[policy]}
            chosen = next((c for c in self.chosen if c.policy == policy), None)
            if chosen is None or not chosen.extend:
                return
            more = extend(tried, self.grid, self.plan.max_points)
            if more is None:
                return
            if not self.affordable(policy, more):
                self.skip(policy, more, "an extension: no time")
                return
            self.extensions.append({"policy": policy, "rps_per_model": more})
            if not self.load_once(node, policy, more, name, result):
                return

    def probe(self, node: Node) -> None:
        """The capacity probe (module docstring): the grid from its measured costs."""
        plan, k = self.plan, self.num_models
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
            "trace": "paper_probe-trace.jsonl", "node": node.name,
            # the node's own, while it runs (its logs' copy is made when it stops)
            "config": str(node.run_dir / "config.yaml"),
            "idle_wait_s": wait_idle(node.url, IDLE_WAIT_S),
        }  # fmt: skip
        if unit is None:
            unit = plan.fallback_unit_rps
            self.capacity["reason"] = "the probe measured no decode step: the plan's guess"
        self.grid = rate_grid(unit, plan.grid_low, plan.grid_high, plan.grid_step)

    def make_plan(self, first: str) -> None:
        """``paper_plan``: every policy predicted on the grid by the simulator calibrated on
        the probe, the rates around each crossing, the order, fitted to the time left."""
        plan = self.plan
        inputs = self.predict_inputs(calibrate_each=False)
        result = self.simulate("paper_plan", inputs, "paper-plan.json")
        self.planned = result
        policies = (result or {}).get("policies") or {}
        self.curves = {p: [(float(q["rps_per_model"]), float(q["predicted"]))
                           for q in (policies.get(p) or {}).get("points") or []]
                       for p in self.policies}  # fmt: skip
        chosen = []
        for policy in self.policies:
            curve = self.curves.get(policy) or []
            if curve:
                chosen.append(choose_rates(policy, curve, plan.points))
            else:  # no prediction: the middle of the grid, measured from there
                middle = self.grid[len(self.grid) // 2]
                chosen.append(PolicyRates(policy, (middle,), "no prediction: the grid's middle"))
        self.chosen = chosen
        budget = self.runner.left_s() - plan.predict_s - STOP_RESERVE_S
        fitted = fit_budget(chosen, self.run_s, self.start_estimate_s(), budget, first=first)
        self.fitted = fitted
        self.pending = list(fitted.order)
        self.plan_note = (f"{len(fitted.order)} runs, ~{fitted.estimate_s:.0f} s of "
                          f"{budget:.0f} s left")  # fmt: skip
        self.runner.say(f"gpu-check: paper plan: {self.plan_note}: " + ", ".join(
            f"{p} {r:.4g}" for p, r in fitted.order))
        for policy, why in fitted.left_out.items():
            self.runner.say(f"gpu-check: paper plan: {policy} left out: {why}")

    def load_once(self, node: Node, policy: str, rate: float, session: str,
                  result: StepResult) -> bool:  # fmt: skip
        """One run; False when it failed (the node is in doubt: its segment ends)."""
        plan, k = self.plan, self.num_models
        index = len(self.runs[policy])
        name = f"paper_{policy}-r{index}"
        started = time.monotonic()
        out = drive_load(self.runner, self.market, node.url, plan.load(k, rate), name,
                         STOP_RESERVE_S)
        files = run_files(self.runner.logs / f"{name}-trace.jsonl")
        model_bytes = {m["name"]: int(m["bytes"]) for m in self.models}
        point = {
            "policy": policy, "rps_per_model": rate, "total_rps": rate * k,
            "load_s": plan.load_duration_s(k, rate), "grace_s": plan.grace_s,
            **run_point(out.get("bench"), files, model_bytes, NUM_INSTANCES,
                        int(self.layout.get("kv_memory_bytes") or 0)),
            "bench_status": out["bench_status"], "bench_error": out.get("bench_error"),
            "trace": f"{name}-trace.jsonl", "node": session,
            "config": f"{session}-run/config.yaml",
            "started_at": round(time.time(), 1),
        }  # fmt: skip
        point["idle_wait_s"] = wait_idle(node.url, IDLE_WAIT_S)
        point["run_s"] = round(time.monotonic() - started, 2)
        self.runs[policy].append(point)
        attainment = point["slo_attainment"]
        self.runner.say(f"gpu-check: {policy} at {rate:.4g} RPS per model ({rate * k:.3g} in "
                        f"all): attainment "
                        f"{'-' if attainment is None else f'{attainment:.1%}'} of "
                        f"{point.get('requests')} requests")  # fmt: skip
        if point.get("bench_status") != "ok":
            result.status = "failed"
            result.error = (f"bench serve {point.get('bench_status')} at {rate:.4g} RPS per "
                            f"model\n{point.get('bench_error') or ''}")  # fmt: skip
            return False
        return True

    # ---- the simulator --------------------------------------------------------------
    def predict_inputs(self, calibrate_each: bool) -> dict[str, Any]:
        """What ``aegaeon_sim.gpu_predict`` reads: the probe's node, and (``calibrate_each``)
        each policy's own node where it ran."""
        probe_node = self.capacity.get("node") or f"paper_{self.policies[0]}"
        probe_config = f"{probe_node}-run/config.yaml"
        if not (self.runner.logs / probe_config).is_file():  # the node is still up
            probe_config = str(self.capacity.get("config") or probe_config)
        calibration = {}
        if calibrate_each:
            calibration = {p: {"trace": runs[-1]["trace"], "config": runs[-1]["config"]}
                           for p, runs in self.runs.items() if runs}  # fmt: skip
        return {
            "logs": str(self.runner.logs), "calibration_trace": "paper_probe-trace.jsonl",
            "calibration_config": probe_config, "calibration": calibration,
            "plan": {"load_s": self.plan.load_s, "grace_s": self.plan.grace_s,
                     "min_requests": self.plan.min_requests},
            "grid": self.grid, "policies": list(self.policies),
            "baseline": {"load_gb_s": self.load_gb_s, "init_s": 0.0},
            "runs": {p: [{"rps_per_model": r["rps_per_model"],
                          "slo_attainment": r["slo_attainment"]} for r in runs]
                     for p, runs in self.runs.items()},
        }  # fmt: skip

    def simulate(self, step: str, inputs: dict[str, Any], file: str) -> dict[str, Any] | None:
        path = self.work / file
        path.write_text(json.dumps(inputs))
        argv = [sys.executable, "-m", "aegaeon_sim.gpu_predict", str(path), "--json"]
        result = self.runner.command(step, argv, max(self.plan.predict_s, 30.0),
                                     parse=lambda out, _err: last_json_line(out))
        return result.results if result.status == "ok" else None

    def predict(self) -> None:
        """``paper_predict``: every policy calibrated on its own node, at its measured rates
        (and the grid)."""
        if not any(self.runs.values()) or not self.capacity:
            self.runner.skip("paper_predict", "no run to calibrate the simulator on")
            return
        inputs = self.predict_inputs(calibrate_each=True)
        measured = sorted({r["rps_per_model"] for runs in self.runs.values() for r in runs})
        inputs["grid"] = measured  # the points beside the measured ones (and the ratio)
        self.predicted = self.simulate("paper_predict", inputs, "paper-predict.json")

    # ---- the JSON section ----------------------------------------------------------
    def section(self) -> dict[str, Any]:
        plan, k = self.plan, self.num_models
        sustainable = {p: sustainable_rate([(r["rps_per_model"], r["slo_attainment"])
                                            for r in runs if r["slo_attainment"] is not None])
                       for p, runs in self.runs.items()}  # fmt: skip
        ratios = {p: rate_ratio(sustainable["aegaeon"], s) for p, s in sustainable.items()
                  if p != "aegaeon" and "aegaeon" in sustainable}  # fmt: skip
        base = next((p for p in ("request-level-charged", "request-level") if p in ratios), None)
        choice = self.built.get("choice") or {}
        fitted = self.fitted
        return {
            "plan": asdict(plan), "target_attainment": TARGET, "policies": list(self.policies),
            "slo": {"ttft_s": plan.ttft_s, "tbt_s": plan.tbt_s, "scaled": plan.slo_note},
            "machine": self.built.get("machine"), "gpu": self.built.get("gpu"),
            "models": [{k2: m.get(k2) for k2 in ("name", "preset", "dtype", "seed", "bytes")}
                       for m in self.models],
            "models_per_gpu": k,
            "model_bytes_total": sum(int(m["bytes"]) for m in self.models),
            "choice": {k2: choice.get(k2) for k2 in ("caps", "binding", "cap_bytes",
                                                     "gpu_model_cap_bytes", "downgrades",
                                                     "dropped")},
            "generate_gb_s": self.built.get("generate_gb_s"),
            "copy_gb_s": self.built.get("copy_gb_s"),
            "baseline": {"load_gb_s": self.load_gb_s, "init_s": 0.0},
            "instances": {"prefill": 1, "decode": 1, "device": plan.device, "mps": self.mps,
                          "mps_note": self.mps_note},
            "layout": self.layout, "device_memory_cap_bytes": self.layout.get(
                "device_memory_bytes"),
            "capacity": self.capacity, "grid_rps_per_model": self.grid,
            "rate_plan": {
                "predicted": {p: [[r, a] for r, a in c] for p, c in self.curves.items()},
                "chosen": [asdict(c) for c in self.chosen],
                "order": [list(o) for o in fitted.order] if fitted else [],
                "estimate_s": fitted.estimate_s if fitted else None,
                "left_out": fitted.left_out if fitted else {},
                "note": self.plan_note, "skipped": self.skipped,
                "extensions": self.extensions,
            },
            "sessions": self.sessions,
            "attainment": {p: {f"{r['rps_per_model']:.4g}": r["slo_attainment"] for r in runs}
                           for p, runs in self.runs.items()},
            "sustainable": sustainable, "ratios": ratios,
            "ratio": ratios[base] if base is not None else None,
            "models_per_gpu_at_paper_rps": {
                p: models_at_paper_rate(s, k) for p, s in sustainable.items()},
            "switches": {p: totals(runs) for p, runs in self.runs.items()},
            "runs": self.runs,
            "predicted": self.predicted,
        }  # fmt: skip


def generation(url: str) -> dict[str, Any] | None:
    """The Model Cache's loads so far (the node's start: every model generated in its
    shared memory): seconds, bytes and GB/s."""
    stats = _stats(url)
    if stats is None:
        return None
    cache = ((stats.get("cache") or {}).get("model_cache")) or {}
    seconds, nbytes = cache.get("load_s_total"), cache.get("loaded_bytes_total")
    if not seconds or not nbytes:
        return {"loads": cache.get("num_loads")}
    return {"loads": cache.get("num_loads"), "load_s_total": seconds,
            "loaded_bytes_total": nbytes, "gb_s": round(nbytes / seconds / 1e9, 3)}


def models_at_paper_rate(rate: dict[str, Any], num_models: int) -> float | None:
    """Models this device serves at 90% at the paper's 0.1 RPS each (Fig. 11a's count):
    the sustainable total rate over 0.1 (a bound is read as its value)."""
    value = rate.get("rps_per_model")
    if value is None:
        return None
    return round(float(value) * num_models / PAPER_RPS_PER_MODEL, 2)


def totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A policy's switches over its runs (what a switch cost it, measured), and the most KV
    and Model Cache it used."""
    switches = [r["switch"] for r in runs if r.get("switch")]
    memory = [r["memory"] for r in runs if r.get("memory")]
    shares = [m["device_kv_peak_share"] for m in memory if m.get("device_kv_peak_share")]
    cache = [m["model_cache"] for m in memory if m.get("model_cache")]
    records = sum(s["records"] for s in switches)
    visible = sum(s["visible_s"] for s in switches)
    return {
        "switches": sum(int(r.get("switches") or 0) for r in runs),
        "records": records,
        "prefetched": sum(s["prefetched"] for s in switches),
        "resident": sum(s.get("resident") or 0 for s in switches),
        "visible_s": round(visible, 4),
        "visible_ms_mean": round(1000 * visible / records, 3) if records else None,
        "visible_ms_p50": [s.get("visible_ms_p50") for s in switches],
        "charged_s": round(sum(s.get("charged_s") or 0.0 for s in switches), 4),
        "visible_share_max": max((s["visible_share"] for s in switches), default=None),
        "copy_gb_s": [s["copy_gb_s"] for s in switches if s.get("copy_gb_s")],
        "device_kv_peak_share": max(shares, default=None),
        "host_kv_peak_bytes": max((m.get("host_kv_peak_bytes") or 0 for m in memory),
                                  default=None),
        "model_cache_used_bytes": max((c.get("used_bytes") or 0 for c in cache), default=None),
        "model_cache_budget_bytes": next((c.get("budget_bytes") for c in cache), None),
        "model_cache_evictions": max((c.get("evictions") or 0 for c in cache), default=None),
    }


def choose_plan(dry: bool, device: str) -> PaperPlan:
    """The dry run's plan, the CPU-scale one (``--device cpu``), or a GPU's."""
    if dry:
        return DRY_PLAN
    if device.startswith("cpu"):
        return CPU_PLAN
    return gpu_plan(device if ":" in device else f"{device}:0")


def run_paper(runner: Runner, work: Path, market: Path, dry: bool, device: str,
              policies: tuple[str, ...] = POLICIES, load_s: float | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """The scenario's steps on ``runner``; its ``paper`` section. ``load_s`` overrides the
    plan's seconds of arrivals per run."""
    plan = choose_plan(dry, device)
    if load_s is not None:
        plan = replace(plan, load_s=load_s)
    scenario = PaperScenario(runner, work, market, plan, policies=policies)
    scenario.run()
    return scenario.section()
