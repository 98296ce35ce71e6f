"""One simulated experiment: a policy, a cluster, a workload -> SLO metrics."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aegaeon_common.config import Config, SchedulerConfig, SLOConfig
from aegaeon_gpumem import suggest_slab_bytes
from aegaeon_sched import (
    ROUND_TTFT_FRACTION,
    SLO,
    AegaeonPolicy,
    ClusterSpec,
    DecodeShare,
    LatencyModel,
    Policy,
    PolicyOptions,
    Request,
    RequestTrace,
    RoleController,
    RoleSettings,
    RoundController,
    RoundRobinPlanner,
    Shedder,
    SLOClasses,
    SLOReport,
    StaticMuxPolicy,
    make_policy,
    summarize,
)
from aegaeon_sched.admission import Bounds, derive_bounds, per_token_prefill_s
from aegaeon_workload.mix import Burst, Mix, assign_classes, generate_bursty
from aegaeon_workload.synthetic import SHAREGPT_OUTPUT, WorkloadSpec, generate

from aegaeon_sim.adapters import AdapterMarket, adapter_market, with_units
from aegaeon_sim.classes import AdmissionGate, reports_by_class, resolve
from aegaeon_sim.driver import Simulation
from aegaeon_sim.hardware import (
    H800,
    Arch,
    Hardware,
    decode_kv_bytes,
    latency_model,
    market,
    unified_kv_bytes,
)
from aegaeon_sim.instances import NodeSetup, SimInstance
from aegaeon_sim.roles_feed import Absorb, RoleFeed, Sample, absorb_times
from aegaeon_sim.shares import DecodeShareFeed
from aegaeon_sim.switching import Eq4Switching, switch_cost
from aegaeon_sim.worker import BLOCK_SIZE, SwitchCost, WorkerCosts, engine_spec

PAPER_SLO = SLO(ttft_s=10.0, tbt_s=0.1)
# ServerlessLLM's loading rate as the paper's artifact simulated it: its
# simulator charges a request-level switch ``mem_size / PCIE`` with
# ``PCIE = 16`` (GB/s) and 14/18/26 GB for Qwen2.5-7B/Yi-1.5-9B/Llama-2-13B
# (25SOSP-Aegaeon, aegaeon/sim/worker.py ``do_swap``, aegaeon/sim/__init__.py
# ``mem_size``). Aegaeon's own switches follow Eq. 4 (51.2 GB/s effective).
SLLM_SWITCH_BYTES_PER_S = 16e9


@dataclass(frozen=True)
class Scenario:
    policy: str
    num_models: int
    rps_per_model: float
    duration_s: float = 600.0  # arrivals in [0, duration)
    seed: int = 0
    input_scale: float = 1.0
    output_scale: float = 1.0
    slo_scale: float = 1.0  # 0.5, 0.3, 0.2 for Fig. 13
    drain_s: float = 300.0  # simulated time after the last arrival
    num_prefill: int = 6
    num_decode: int = 10
    prefetch: bool = True
    q_max_s: float = 4.0
    # Aegaeon's round bound (a fraction of TTFT; None: the paper's Eq. 3) and
    # fresh-first re-planning: see aegaeon_sched.quota.
    round_ttft_fraction: float | None = ROUND_TTFT_FRACTION
    fresh_first: bool = False
    # Beyond the paper (as the live system): prefill instances decode when no
    # prefill waits (the decode loop's prefill side); a new decode batch goes to the work list
    # with the fewest batches per unit of decode share (shares.py, as the live
    # proxy), or with "shortest" to the strictly shortest (decode instances
    # first on ties); "busy-share": decode share counting the prefills'
    # switches as busy too (not the proxy's rule).
    hybrid_prefill: bool = False
    hybrid_placement: str = "decode-share"
    max_batch_size: int = 256
    # Request-level baselines' switch: weight_bytes / this rate (default: the
    # artifact's ServerlessLLM); None = Eq. 4 like Aegaeon.
    baseline_switch_bytes_per_s: float | None = SLLM_SWITCH_BYTES_PER_S
    # Every switch copies this share of a model's bf16 bytes (0.5: FP8 or Q8_0
    # weights; issue 27's density run): Aegaeon's Eq. 4 and the baselines' copy alike.
    switch_scale: float = 1.0
    # Past the paper (issue 19; classes.py, roles_feed.py). SLO classes drawn
    # per request (e.g. (("interactive", 0.3), ("batch", 0.7))), scored per
    # class against the class's targets; with ``slo_classes`` the scheduler sees
    # them (False: the single-SLO scheduler on the same trace).
    class_mix: Mix = ()
    slo_classes: bool = True
    # The proxy's admission bounds in front of the policy; with classes seen,
    # shedding by class (aegaeon_sched.Shedder, at most ``max_deferred`` waiting).
    admission: bool = False
    max_deferred: int = 256
    # the operator's proxy.max_kv_blocks (None: derived, the decoders' device KV)
    kv_blocks_bound: int | None = None
    # Role switching by token velocity (aegaeon_sched.RoleController): every
    # instance prefill- and decode-capable, the decode ones starting in standby.
    roles: bool = False
    burst: Burst | None = None  # ON/OFF arrivals; rps_per_model is the OFF rate
    # LoRA adapters (adapters.py): this many per model, each with its own request stream
    # (rps_per_model) and the models none; a base and its adapters are one switching unit
    adapters_per_model: int = 0
    adapter_rank: int = 16

    @property
    def slo(self) -> SLO:
        return PAPER_SLO.scaled(self.slo_scale)

    @property
    def slo_classes_spec(self) -> SLOClasses:
        """The deployment's classes: the defaults of its SLO (aegaeon_sched.priority)."""
        return SLOClasses.default(self.slo.ttft_s, self.slo.tbt_s)


@dataclass(frozen=True)
class ScenarioResult:
    scenario: Scenario
    report: SLOReport
    num_rejected: int
    num_switches: int  # weight switches (adapter loads are not)
    exposed_switch_mean_s: float
    near_instant_switch_share: float  # decode switches hidden to under 50 ms
    wall_s: float
    traces: list[RequestTrace] = field(default_factory=list, repr=False)
    by_class: dict[str, SLOReport] = field(default_factory=dict)  # with a class mix
    admission: dict[str, object] = field(default_factory=dict)  # refused/deferred by class
    role_changes: int = 0
    samples: list[Sample] = field(default_factory=list, repr=False)  # heartbeats
    absorb: list[Absorb] = field(default_factory=list)  # per burst
    adapter_loads: int = 0  # adapters brought to an instance (first run there)


class ExactLatency(LatencyModel):
    """Eq. 4-6 known exactly (the paper's hardware model): an instance's loop refines
    its estimates with every step it measures, and measuring these very values
    changes nothing, so observations are not kept (they cost a decode step's time)."""

    def observe_decode(
        self, model: str, batch_size: int, context_tokens: int, seconds: float
    ) -> None:
        pass

    def observe_prefill(self, model: str, prompt_lens: Sequence[int], seconds: float) -> None:
        pass


@dataclass
class _Built:
    sim: Simulation
    decode: list[SimInstance]  # Aegaeon's decode-capable instances (their switches exposed)
    gate: AdmissionGate | None = None
    feed: RoleFeed | None = None
    class_of: dict[str, str] = field(default_factory=dict)  # request id -> class (a mix's)


def _hybrid(sc: Scenario) -> bool:
    return sc.policy == "aegaeon" and (sc.hybrid_prefill or sc.roles)


def _cluster(sc: Scenario) -> ClusterSpec:
    prefill = tuple(f"prefill-{i}" for i in range(sc.num_prefill))
    decode = tuple(f"decode-{i}" for i in range(sc.num_decode))
    if sc.policy == "aegaeon" and sc.roles:
        # every instance can take either role; the decode ones start in standby
        return ClusterSpec(prefill + decode, decode + prefill)
    if _hybrid(sc):
        decode += prefill  # decode instances first: Alg. 2 breaks ties by order
    return ClusterSpec(prefill, decode)


def workload(sc: Scenario, models: Sequence[str],
             adapters: AdapterMarket | None = None) -> tuple[list[Request], dict[str, str]]:
    """The scenario's requests (with their classes' targets when the scheduler sees
    them) and each request's class (empty without a mix); with ``adapters``, the
    requests are the adapters' (their bases their switching units)."""
    streams = tuple(adapters.names) if adapters is not None else tuple(models)
    spec = WorkloadSpec(streams, sc.rps_per_model, sc.duration_s, sc.seed,
                        sc.input_scale, sc.output_scale)  # fmt: skip
    requests = generate_bursty(spec, sc.burst) if sc.burst is not None else generate(spec)
    if adapters is not None:
        requests = with_units(requests, adapters)
    if not sc.class_mix:
        return requests, {}
    class_of = assign_classes(requests, sc.class_mix, sc.seed)
    if sc.slo_classes:
        requests = resolve(requests, sc.slo_classes_spec, class_of)
    return requests, class_of


def _node(sc: Scenario, options: PolicyOptions, lat: LatencyModel, hw: Hardware,
          units: Mapping[str, str] | None = None) -> NodeSetup:
    """What the simulated instances share: the scenario's settings as the loops read
    them (the SLO, the planner, the policy; every step's tokens sent at once, as the
    paper's system streams them), the models' KV shapes, KV moving at the host link's
    effective rate (Eq. 4's)."""
    config = Config(
        models=(), slo=SLOConfig(sc.slo.ttft_s, sc.slo.tbt_s),
        scheduler=SchedulerConfig(
            policy=sc.policy,  # type: ignore[arg-type]
            max_group_size=options.max_group_size, q_max_s=sc.q_max_s,
            round_ttft_fraction=sc.round_ttft_fraction, max_batch_size=sc.max_batch_size,
            prefetch=sc.prefetch, token_hold=0.0,
        ),
    )  # fmt: skip
    specs = {m: engine_spec(s) for m, s in lat.specs.items()}
    block = max(s.kv_shape(config.dtype, BLOCK_SIZE).block_bytes for s in specs.values())
    return NodeSetup(config, specs, suggest_slab_bytes(block),
                     WorkerCosts(copy_bytes_per_s=hw.pcie_effective_bytes_per_s),
                     units=dict(units or {}))  # fmt: skip


def _build(sc: Scenario, models: dict[str, Arch], hw: Hardware, lat: LatencyModel,
           adapters: AdapterMarket | None = None) -> _Built:
    cluster = _cluster(sc)
    requests, class_of = workload(sc, tuple(models), adapters)
    decode_kv = decode_kv_bytes(models, hw)
    mean_out = SHAREGPT_OUTPUT.mean * sc.output_scale
    options = PolicyOptions(
        max_batch_size=sc.max_batch_size,
        decode_capacity_tokens={
            m: int(decode_kv // a.kv_bytes_per_token) for m, a in models.items()
        },
        unified_capacity_tokens={
            m: int(unified_kv_bytes(a, hw) // a.kv_bytes_per_token) for m, a in models.items()
        },
        model_loads={
            m: sc.rps_per_model * mean_out * lat.decode_step_s(m, 1, 1000) for m in models
        },
        gpu_weight_budget_bytes=int(hw.usable_bytes),
        decode_tbt_s=sc.slo.tbt_s,
        default_ttft_s=sc.slo.ttft_s if sc.class_mix else 0.0,
        standby=tuple(f"decode-{i}" for i in range(sc.num_decode)) if sc.roles else (),
        role_switching=sc.roles,
        units=adapters.units if adapters is not None else {},
    )
    inner = make_policy(sc.policy, cluster, lat, options)
    policy: Policy = inner
    gate = None
    if sc.admission:
        host_kv = min(int(hw.host_kv_cache_bytes // a.kv_bytes_per_token) for a in models.values())
        # the proxy's derived bounds (aegaeon_proxy.cluster.requests.bounds_of), homogeneous
        bounds = derive_bounds(Bounds(kv_blocks=sc.kv_blocks_bound), ttft_s=sc.slo.ttft_s,
                               prefill_s_per_token=[per_token_prefill_s(lat, models)]
                               * sc.num_prefill, host_kv_tokens=host_kv,
                               decode_capacity_tokens=[options.decode_capacity_tokens]
                               * len(cluster.decode_instances))  # fmt: skip
        seen = bool(sc.class_mix) and sc.slo_classes
        shedder = Shedder(sc.slo_classes_spec, sc.max_deferred) if seen else None
        policy = gate = AdmissionGate(inner, bounds, shedder, class_of)
    sim = Simulation(policy, requests)
    node = _node(sc, options, lat, hw, options.units)
    # What work takes, and what every instance plans with: the hardware's Eq. 4-6
    # exactly (the policy refines its own copy, lat, from the prefills it sees).
    truth = ExactLatency.from_dict(lat.to_dict())

    def add(name: str, role: str, kv_region: float, switch_s: SwitchCost,
            rounds: RoundController | None = None) -> SimInstance:  # fmt: skip
        return sim.add_instance(name, role, node, truth=truth, estimator=truth,
                                kv_region_bytes=int(kv_region), switch_s=switch_s,
                                rounds=rounds)  # fmt: skip

    if sc.policy == "aegaeon":
        switching = Eq4Switching(lat, hw.d2d_bytes_per_s)

        def eq4(model: str, prefetch: tuple[str, float] | None, now_s: float) -> float:
            return switch_cost(switching, model, prefetch, now_s)

        planner = RoundRobinPlanner(
            sc.slo.tbt_s, sc.q_max_s, ttft_s=sc.slo.ttft_s,
            round_ttft_fraction=sc.round_ttft_fraction, fresh_first=sc.fresh_first,
        )  # fmt: skip
        hybrid = _hybrid(sc)
        prefills = [
            add(name, "hybrid" if hybrid else "prefill", decode_kv, eq4,
                RoundController(planner, share=DecodeShare()) if hybrid else None)
            for name in cluster.prefill_instances
        ]  # fmt: skip
        decodes = [add(name, "decode", decode_kv, eq4, RoundController(planner))
                   for name in cluster.decode_instances
                   if name not in cluster.prefill_instances]  # fmt: skip
        if hybrid:
            decodes += prefills
            if sc.hybrid_placement in ("decode-share", "busy-share"):
                shares = DecodeShareFeed(inner, prefills,
                                         with_switches=sc.hybrid_placement == "busy-share")
                shares.start(sim.schedule, sc.duration_s + sc.drain_s)  # fmt: skip
            elif sc.hybrid_placement != "shortest":
                raise ValueError(f"unknown hybrid placement {sc.hybrid_placement!r}")
        feed = None
        if sc.roles or sc.burst is not None:
            assert isinstance(inner, AegaeonPolicy)
            controller = None
            if sc.roles:
                base = {p.name: "prefill" for p in prefills[: sc.num_prefill]}
                base |= {p.name: "decode" for p in prefills[sc.num_prefill :]}
                settings = RoleSettings(backlog_horizon_s=sc.slo.ttft_s / 2)  # the config's null
                controller = RoleController(base, settings)
            feed = RoleFeed(inner, prefills, requests, lat, tuple(models), sim.apply, controller)
            feed.start(sim.schedule, sc.duration_s + sc.drain_s)
        return _Built(sim, decodes, gate, feed, class_of)
    if isinstance(policy, StaticMuxPolicy):
        for name in cluster.unified_instances:
            resident = sum(models[m].weight_bytes for m in policy.models_on(name))
            add(name, "unified", hw.usable_bytes - resident, lambda m, p, now: lat.switch_s(m))
        return _Built(sim, [], class_of=class_of)
    rate = sc.baseline_switch_bytes_per_s

    def baseline(model: str, prefetch: tuple[str, float] | None, now_s: float) -> float:
        if rate is None:
            return lat.switch_s(model)
        return lat.spec(model).weight_bytes * sc.switch_scale / rate

    largest = max(a.weight_bytes for a in models.values())
    for name in cluster.unified_instances:
        add(name, "unified", hw.usable_bytes - largest, baseline)
    return _Built(sim, [], class_of=class_of)


def run_scenario(
    sc: Scenario, *, hw: Hardware = H800, keep_traces: bool = False, tbt_percentiles: bool = False
) -> ScenarioResult:
    started = time.perf_counter()
    models = market(sc.num_models)
    lat = latency_model(models, hw)
    lat.switch_beta *= sc.switch_scale  # Eq. 4 alone: KV moves keep the link's rate
    adapters = (adapter_market(models, sc.adapters_per_model, sc.adapter_rank, lat)
                if sc.adapters_per_model else None)  # fmt: skip
    built = _build(sc, models, hw, lat, adapters)
    built.sim.run(sc.duration_s + sc.drain_s)
    traces = built.sim.traces()
    report = summarize(traces, sc.slo, tbt_percentiles=tbt_percentiles)
    switches = sum(i.counters.switches for i in built.sim.instances.values())
    decode_costs = [r.total_s for d in built.decode for r in d.counters.new_switches]
    feed = built.feed
    by_class = {}
    if sc.class_mix:
        by_class = reports_by_class(traces, sc.slo_classes_spec, built.class_of,
                                    tbt_percentiles=tbt_percentiles)  # fmt: skip
    return ScenarioResult(
        scenario=sc,
        report=report,
        num_rejected=len(built.sim.rejected),
        num_switches=switches,
        exposed_switch_mean_s=sum(decode_costs) / len(decode_costs) if decode_costs else 0.0,
        near_instant_switch_share=(
            sum(c < 0.05 for c in decode_costs) / len(decode_costs) if decode_costs else 0.0
        ),
        wall_s=time.perf_counter() - started,
        traces=traces if keep_traces else [],
        by_class=by_class,
        admission=built.gate.snapshot() if built.gate is not None else {},
        role_changes=len(feed.controller.changes) if feed and feed.controller else 0,
        samples=feed.samples if feed is not None else [],
        absorb=(absorb_times(feed.samples, sc.burst.starts(sc.duration_s))
                if feed is not None and sc.burst is not None else []),
        adapter_loads=built.sim.adapter_loads(),
    )  # fmt: skip
