"""A simulated live node: the deployment `aegaeon serve` ran, with its profiles and measured costs.

:class:`NodeSpec` describes what a live run used (``TRACE.stats.json``'s
``layout`` and ``latency``, the serve config's planner settings, the costs
:mod:`aegaeon_sim.node_costs` measured); :func:`simulate_node` plays the
same policy object over it:

- Aegaeon: ``prefill-0..P-1`` and ``decode-0..D-1``; with ``hybrid_prefill``
  the prefill instances are hybrids listed after the decode instances as
  Algorithm 2 targets, fed decode shares every 0.5 s as the proxy does
  (shares.py); every decode instance runs the live loop's round
  controller (``aegaeon_sched.RoundController``).
- Request-level policies: ``decode-0..P+D-1`` unified instances that prefill
  one request at a time before their decode steps (as the live decode loop's
  ``_prefill_new``) and switch only when idle; ``request-level-charged``'s
  switches take the larger of the measured switch and its load path
  (``load_path``: ``aegaeon_sched.load_path``, as the live instances wait it
  out).
- ``static-mux``: the same unified instances, each holding the models the
  policy placed on it resident (``weights_budget_bytes``: its arena) and their
  requests in its KV region (``kv_region_bytes``); no switch.

Each instance runs on its own start-up profile (what the live instance
fitted) with Eq. 5 replaced by the refit to the run's measured prefills when
there is one and Eq. 6 scaled by the measured decode slowdown; its planner
estimates with the unmodified profile, refined with every simulated step as
the live instance refines it with every measured one; the policy (Alg. 1-2)
with the prefill instance's (the live proxy's choice). Switches are
priced as measured (``switch_model="measured"``) or by the profiles' Eq. 4
(``"eq4"``, for comparison); per-step, per-turn and per-prefill overheads
from the costs. The decode planner's switch estimate is the live one (Eq. 4
or the learned turn overhead, whichever is larger).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aegaeon_sched import (
    SLO,
    ClusterSpec,
    LatencyModel,
    LoadPath,
    PolicyOptions,
    Request,
    RequestTrace,
    RoundRobinPlanner,
    StaticMuxPolicy,
    make_policy,
)

from aegaeon_sim.decode_sim import DecodeSim
from aegaeon_sim.driver import Simulation
from aegaeon_sim.hybrid_sim import HybridSim
from aegaeon_sim.node_costs import NodeCosts
from aegaeon_sim.shares import DecodeShareFeed
from aegaeon_sim.switching import (
    Eq4Switching,
    InstanceCosts,
    MeasuredSwitching,
    Switching,
)
from aegaeon_sim.turn_meter import TurnLog
from aegaeon_sim.unified_sim import MuxSim, RequestLevelSim


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
    kv_region_bytes: int | None = None  # an instance's KV region (static-mux admission)
    weights_budget_bytes: int | None = None  # an instance's weights arena (static-mux)

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

    def unified_switch_s(self, lat: LatencyModel) -> Callable[[str], float]:
        """What a unified instance's switch to a model costs: as measured (or Eq. 4),
        the load path's time when it is longer (``request-level-charged``)."""
        full_s = self.switching(lat).full_s
        path = self.load_path
        if path is None:
            return full_s
        return lambda model: path.switch_s(lat.spec(model).weight_bytes, full_s(model))


@dataclass
class NodeRun:
    """A simulated run: traces in :class:`Request` order, and what the instances did."""

    traces: list[RequestTrace]
    num_switches: int
    num_steps: int
    engine_s: float
    decode_shares: dict[str, float]
    turns: dict[str, list[TurnLog]]


def _cluster(spec: NodeSpec) -> ClusterSpec:
    names = spec.instance_names
    if spec.unified:
        return ClusterSpec((), names)
    prefill = tuple(n for n in names if n.startswith("prefill-"))
    decode = tuple(n for n in names if n.startswith("decode-"))
    if spec.hybrid_prefill:
        decode += prefill  # decode instances first, as the live proxy lists them
    return ClusterSpec(prefill, decode)


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
    kv_rate = policy_latency.pcie_bytes_per_s
    sim = Simulation(policy, policy_latency, requests, kv_bytes_per_s=kv_rate)
    costs = spec.costs
    switches: list[Any] = []
    unified: list[RequestLevelSim | MuxSim] = []
    decodes: list[DecodeSim] = []
    feed: DecodeShareFeed | None = None
    if spec.unified:
        for name in names:
            truth = spec.truth(name)
            inst: RequestLevelSim | MuxSim
            if isinstance(policy, StaticMuxPolicy):
                inst = MuxSim(name, truth, float(spec.kv_region_bytes or 0))
            else:
                inst = RequestLevelSim(name, truth, switch_cost=spec.unified_switch_s(truth))
            inst.prefill_one_by_one, inst.step_overhead_s = True, costs.step_overhead_s
            sim.add_unified(inst)
            unified.append(inst)
            switches.append(inst)
    else:
        planner = RoundRobinPlanner(
            spec.planner_slo.tbt_s, spec.q_max_s, ttft_s=spec.planner_slo.ttft_s,
            round_ttft_fraction=spec.round_ttft_fraction,
        )  # fmt: skip
        hybrids = []
        for name in names:
            truth = spec.truth(name)
            switching = spec.switching(truth)
            inst_costs = InstanceCosts(switching, costs.step_overhead_s, costs.turn_overhead_s,
                                       costs.cold_step_s, learned_switch_estimate=True)  # fmt: skip
            common: dict[str, Any] = {
                "kv_bytes_per_s": kv_rate, "costs": inst_costs, "prefetch": spec.prefetch,
                "estimator": spec.profile(name),
            }  # fmt: skip
            if name.startswith("prefill-"):
                prefill = sim.add_prefill(name, switching=switching, prefetch=spec.prefetch,
                                          latency=truth, overhead_s=costs.prefill_overhead_s)
                switches.append(prefill)  # fmt: skip
                if spec.hybrid_prefill:
                    hybrids.append(prefill)
                    decodes.append(HybridSim(prefill, truth, planner, **common))
            else:
                decodes.append(DecodeSim(name, truth, planner, **common))
        for d in decodes:
            d.meter.refine = True  # as the live instances (observe_decode every step)
            sim.add_decode(d)
        if hybrids:
            feed = DecodeShareFeed(policy, hybrids)
            feed.start(sim.schedule, end_s)
    sim.run(end_s)
    traces = [sim.sims[r.request_id].trace() for r in requests]
    return NodeRun(
        traces=traces,
        num_switches=sum(int(s.num_switches) for s in switches)
        + sum(len(d.switch_costs) for d in decodes),
        num_steps=sum(d.meter.num_steps for d in decodes) + sum(u.num_steps for u in unified),
        engine_s=sum(d.meter.engine_s for d in decodes) + sum(u.engine_s for u in unified),
        decode_shares={h: feed.mean_share(h) for h in feed.shares} if feed else {},
        turns={d.name: d.meter.log for d in decodes},
    )
