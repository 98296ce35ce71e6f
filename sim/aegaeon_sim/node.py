"""A simulated live node: the deployment `aegaeon serve` ran, with its profiles and measured costs.

:class:`NodeSpec` describes what a live run used (``TRACE.stats.json``'s
``layout`` and ``latency``, the serve config's planner settings, the costs
:mod:`aegaeon_sim.node_costs` measured); :func:`simulate_node` plays the
same policy object over the same instance loops (:mod:`aegaeon_sim.instances`):

- Aegaeon: ``prefill-0..P-1`` and ``decode-0..D-1``; with ``hybrid_prefill``
  the prefill instances are hybrids listed after the decode instances as
  Algorithm 2 targets, fed decode shares every 0.5 s as the proxy does
  (shares.py).
- Request-level policies: ``decode-0..P+D-1`` unified instances (the decode
  loop serving ``RunRequest``: one request's prefill at a time before the
  decode steps, a switch only when idle); ``request-level-charged``'s loops
  wait out ``load_path`` at each scale-up, as live.
- ``static-mux``: the same unified instances, each keeping the models the
  policy placed on it resident (``weights_budget_bytes``: its arena) and their
  requests in its KV region (``kv_region_bytes``).

Each instance does its work as its own start-up profile (what the live instance
fitted) says, with Eq. 5 replaced by the refit to the run's measured prefills when
there is one and Eq. 6 scaled by the measured decode slowdown; its loop plans with
the unmodified profile, refined with every simulated step as the live loop refines
it with every measured one; the policy (Alg. 1-2) with the prefill instance's (the
live proxy's choice). Switches are priced as measured
(``switch_model="measured"``) or by the profiles' Eq. 4 (``"eq4"``, for
comparison); the loop's own time as measured (:class:`~aegaeon_sim.worker.WorkerCosts`:
per pass between steps, per activation, per swap-out order; the first step after
a switch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aegaeon_common.config import (
    BaselineConfig,
    CacheConfig,
    Config,
    SchedulerConfig,
    SLOConfig,
)
from aegaeon_gpumem import suggest_slab_bytes
from aegaeon_sched import (
    SLO,
    ClusterSpec,
    LatencyModel,
    LoadPath,
    PolicyOptions,
    Request,
    RequestTrace,
    make_policy,
)

from aegaeon_sim.driver import Simulation
from aegaeon_sim.instances import NodeSetup, SimInstance
from aegaeon_sim.node_costs import NodeCosts
from aegaeon_sim.shares import DecodeShareFeed
from aegaeon_sim.switching import Eq4Switching, MeasuredSwitching, Switching, switch_cost
from aegaeon_sim.worker import BLOCK_SIZE, WorkerCosts, engine_spec

# A node whose serve config is unknown: its policy has no KV bound (no capacity
# tokens), and its instances a region that never fills.
UNKNOWN_KV_REGION_BYTES = 64 << 30


@dataclass(frozen=True)
class NodeSpec:
    """One live deployment, as the simulator needs it (see the module docstring)."""

    policy: str
    num_prefill: int
    num_decode: int
    unified: bool
    hybrid_prefill: bool
    profiles: Mapping[str, Mapping[str, Any]]  # instance -> LatencyModel.to_dict()
    planner_slo: SLO  # the SLO the live planner used (serve config), not the scoring one
    costs: NodeCosts
    q_max_s: float = 4.0
    round_ttft_fraction: float | None = 0.7
    max_batch_size: int = 32
    max_group_size: int = 8
    prefetch: bool = True
    capacity_tokens: Mapping[str, int] = field(default_factory=dict)
    switch_model: str = "measured"  # or "eq4"
    load_path: LoadPath | None = None  # request-level-charged's scale-ups
    kv_region_bytes: int | None = None  # an instance's KV region (None: unknown, unbounded)
    weights_budget_bytes: int | None = None  # an instance's weights arena (static-mux)
    token_hold: float = 1.0  # the decode instances' (scheduler.token_hold)

    @property
    def instance_names(self) -> tuple[str, ...]:
        if self.unified:
            return tuple(f"decode-{i}" for i in range(self.num_prefill + self.num_decode))
        return tuple(f"prefill-{i}" for i in range(self.num_prefill)) + tuple(
            f"decode-{i}" for i in range(self.num_decode)
        )

    def profile(self, instance: str) -> LatencyModel:
        """A fresh copy of ``instance``'s start-up profile (any instance's if it has none)."""
        data = self.profiles.get(instance) or next(iter(self.profiles.values()))
        return LatencyModel.from_dict(data)

    def truth(self, instance: str) -> LatencyModel:
        """What ``instance``'s work takes: its profile with Eq. 5 as refitted to the
        run (times ``prefill_scale``) and Eq. 6 scaled by the measured ``decode_scale``
        (and ``model_scale``)."""
        lat = self.profile(instance)
        for model, coef in self.costs.prefill_coef.items():
            lat.set_prefill_coefficients(model, coef)
        if self.costs.prefill_scale != 1.0:
            lat.scale_coefficients("prefill", {}, self.costs.prefill_scale)
        scale, per_model = self.costs.decode_scale, self.costs.model_scale
        if scale != 1.0 or per_model:
            factors = {m: scale * f for m, f in per_model.items()}
            lat.scale_coefficients("decode", factors, scale)
        return lat

    def switching(self, lat: LatencyModel) -> Switching:
        if self.switch_model == "eq4":
            return Eq4Switching(lat, float("inf"))  # CPU: a prefetched model stays in place
        weights = {m: s.weight_bytes for m, s in lat.specs.items()}
        return MeasuredSwitching(self.costs.switch, weights)

    def config(self) -> Config:
        """The deployment as the instances' loops read it."""
        path = self.load_path
        baseline = (BaselineConfig() if path is None else
                    BaselineConfig(load_gb_s=path.bytes_per_s / 1e9, init_s=path.init_s))
        return Config(
            models=(), slo=SLOConfig(self.planner_slo.ttft_s, self.planner_slo.tbt_s),
            scheduler=SchedulerConfig(
                policy=self.policy,  # type: ignore[arg-type]
                max_group_size=self.max_group_size, q_max_s=self.q_max_s,
                round_ttft_fraction=self.round_ttft_fraction,
                max_batch_size=self.max_batch_size, prefetch=self.prefetch,
                token_hold=self.token_hold,
            ),
            baseline=baseline,
        )  # fmt: skip


@dataclass
class NodeRun:
    """A simulated run: traces in :class:`Request` order, and what the instances did."""

    traces: list[RequestTrace]
    num_switches: int
    num_steps: int
    engine_s: float
    decode_shares: dict[str, float]


def _cluster(spec: NodeSpec) -> ClusterSpec:
    names = spec.instance_names
    if spec.unified:
        return ClusterSpec((), names)
    prefill, decode = names[: spec.num_prefill], names[spec.num_prefill :]
    if spec.hybrid_prefill:
        decode += prefill  # decode instances first, as the live proxy lists them
    return ClusterSpec(prefill, decode)


def _node(spec: NodeSpec, lat: LatencyModel) -> NodeSetup:
    config = spec.config()
    specs = {m: engine_spec(s) for m, s in lat.specs.items()}
    block = max(s.kv_shape(config.dtype, BLOCK_SIZE).block_bytes for s in specs.values())
    c = spec.costs
    costs = WorkerCosts(
        cold_step_s=c.cold_step_s, activate_s=c.turn_overhead_s,
        # a prefill's time besides its compute and switch: its activation and its swap-out
        swap_out_order_s=max(0.0, c.prefill_overhead_s - c.turn_overhead_s),
        copy_bytes_per_s=lat.pcie_bytes_per_s,
    )  # fmt: skip
    slab = max(CacheConfig().slab_bytes, suggest_slab_bytes(block))
    return NodeSetup(config, specs, slab, costs, poll_s=c.step_overhead_s)


def simulate_node(spec: NodeSpec, requests: Sequence[Request], end_s: float) -> NodeRun:
    """Play ``requests`` (arrivals as the proxy saw them) on the node until ``end_s``."""
    cluster = _cluster(spec)
    names = spec.instance_names
    policy_latency = spec.profile(next((n for n in names if n.startswith("prefill-")), names[0]))
    cap = dict(spec.capacity_tokens)
    options = PolicyOptions(max_group_size=spec.max_group_size,
                            max_batch_size=spec.max_batch_size,
                            decode_capacity_tokens=cap, unified_capacity_tokens=cap,
                            decode_tbt_s=spec.planner_slo.tbt_s,
                            gpu_weight_budget_bytes=spec.weights_budget_bytes)  # fmt: skip
    policy = make_policy(spec.policy, cluster, policy_latency, options)
    sim = Simulation(policy, requests)
    node = _node(spec, policy_latency)
    kv_region = spec.kv_region_bytes or UNKNOWN_KV_REGION_BYTES
    instances: list[SimInstance] = []
    for name in names:
        truth = spec.truth(name)
        switching = spec.switching(truth)

        def switch_s(model: str, prefetch: tuple[str, float] | None, now_s: float,
                     switching: Switching = switching) -> float:  # fmt: skip
            return switch_cost(switching, model, prefetch, now_s)

        if spec.unified:
            role = "unified"
        elif name.startswith("prefill-"):
            role = "hybrid" if spec.hybrid_prefill else "prefill"
        else:
            role = "decode"
        instances.append(sim.add_instance(name, role, node, truth=truth,
                                          estimator=spec.profile(name),
                                          kv_region_bytes=kv_region, switch_s=switch_s))
    hybrids = [i for i in instances if i.role == "hybrid"]
    feed = None
    if hybrids:
        feed = DecodeShareFeed(policy, hybrids)
        feed.start(sim.schedule, end_s)
    sim.run(end_s)
    decoding = [i for i in instances if i.role != "prefill"]
    return NodeRun(
        traces=sim.traces(),
        num_switches=sum(i.counters.switches for i in instances),
        num_steps=sum(i.counters.steps for i in decoding),
        engine_s=sum(i.counters.decode_s for i in decoding),
        decode_shares={h: feed.mean_share(h) for h in feed.shares} if feed else {},
    )
