"""Build a policy from its configured name (one table, no if/elif chain)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aegaeon_sched.actions import Policy
from aegaeon_sched.aegaeon_policy import AegaeonPolicy
from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.prefill import MAX_GPSIZE
from aegaeon_sched.request import InstanceId
from aegaeon_sched.request_level import RequestLevelPolicy
from aegaeon_sched.request_pinned import PinnedRequestLevelPolicy
from aegaeon_sched.static_mux import StaticMuxPolicy


@dataclass(frozen=True)
class ClusterSpec:
    """The instances a policy may use. Request-level and static policies use
    every GPU as a unified instance (prefill ones first)."""

    prefill_instances: tuple[InstanceId, ...]
    decode_instances: tuple[InstanceId, ...]

    @property
    def unified_instances(self) -> tuple[InstanceId, ...]:
        return self.prefill_instances + self.decode_instances


@dataclass(frozen=True)
class PolicyOptions:
    max_group_size: int = MAX_GPSIZE
    max_batch_size: int = 256
    # Device KV capacity in tokens, per model: decode instances (Aegaeon) and
    # unified instances (baselines) have different budgets (prefetch slot).
    decode_capacity_tokens: Mapping[str, int] = field(default_factory=dict)
    unified_capacity_tokens: Mapping[str, int] = field(default_factory=dict)
    # Static multiplexing: expected load per model (default: equal) and the
    # bytes a GPU may give to resident weights (default: unchecked).
    model_loads: Mapping[str, float] = field(default_factory=dict)
    gpu_weight_budget_bytes: int | None = None
    max_models_per_gpu: int = 2
    # Aegaeon: the TBT target the decode instances plan for, to place batches
    # by decode demand; None: by batch count (the paper).
    decode_tbt_s: float | None = None
    # Aegaeon: the TTFT of a request carrying none (SLO classes order prefill
    # groups by first-token deadline); prefill-capable instances that start in
    # the decode role (role switching: aegaeon_sched.roles).
    default_ttft_s: float = 0.0
    standby: tuple[InstanceId, ...] = ()
    # Roles move (aegaeon_sched.roles): new decode requests avoid the instances in
    # the prefill role while one in the decode role is open.
    role_switching: bool = False


def _aegaeon(cluster: ClusterSpec, latency: LatencyModel, opts: PolicyOptions) -> Policy:
    policy = AegaeonPolicy(
        cluster.prefill_instances,
        cluster.decode_instances,
        latency,
        max_group_size=opts.max_group_size,
        max_batch_size=opts.max_batch_size,
        decode_tbt_s=opts.decode_tbt_s,
        default_ttft_s=opts.default_ttft_s,
        standby=opts.standby,
        role_switching=opts.role_switching,
    )
    for instance in cluster.decode_instances:
        for model, tokens in opts.decode_capacity_tokens.items():
            policy.decode.set_capacity(instance, model, tokens)
    return policy


def _request_level(
    cls: type[RequestLevelPolicy], sjf: bool, name: str | None = None
) -> Callable[[ClusterSpec, LatencyModel, PolicyOptions], Policy]:
    def build(cluster: ClusterSpec, latency: LatencyModel, opts: PolicyOptions) -> Policy:
        policy = cls(
            cluster.unified_instances,
            sjf=sjf,
            max_batch_size=opts.max_batch_size,
            capacity_tokens=opts.unified_capacity_tokens,
        )
        if name is not None:
            policy.name = name
        return policy

    return build


def _static_mux(cluster: ClusterSpec, latency: LatencyModel, opts: PolicyOptions) -> Policy:
    loads = dict(opts.model_loads) or dict.fromkeys(latency.specs, 1.0)
    return StaticMuxPolicy(
        cluster.unified_instances,
        loads,
        max_models_per_gpu=opts.max_models_per_gpu,
        weight_bytes={m: s.weight_bytes for m, s in latency.specs.items()},
        gpu_weight_budget_bytes=opts.gpu_weight_budget_bytes,
    )


# The request-level baselines: ServerlessLLM (FCFS) and ServerlessLLM+ (oracle
# SJF) as the paper evaluated them, requests bound to an instance at arrival
# (request_pinned.py); "-global": the idealised global-queue variants
# (request_level.py), stronger, reported as an extra line; "-charged": FCFS whose
# scale-ups pay ServerlessLLM's load path (load_path.py: the instances wait it out,
# the simulator prices it), the same decisions.
POLICIES: dict[str, Callable[[ClusterSpec, LatencyModel, PolicyOptions], Policy]] = {
    "aegaeon": _aegaeon,
    "request-level": _request_level(PinnedRequestLevelPolicy, sjf=False),
    "request-level-charged": _request_level(PinnedRequestLevelPolicy, sjf=False,
                                            name="request-level-charged"),
    "request-level-sjf": _request_level(PinnedRequestLevelPolicy, sjf=True),
    "request-level-global": _request_level(RequestLevelPolicy, sjf=False),
    "request-level-global-sjf": _request_level(RequestLevelPolicy, sjf=True),
    "static-mux": _static_mux,
}


def make_policy(
    name: str,
    cluster: ClusterSpec,
    latency: LatencyModel,
    options: PolicyOptions | None = None,
) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    try:
        build = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}") from None
    return build(cluster, latency, options or PolicyOptions())
