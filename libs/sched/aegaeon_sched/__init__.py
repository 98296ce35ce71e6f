"""aegaeon_sched: Aegaeon's scheduling policies as pure code.

No I/O, no clock (time is always an argument), no torch/zmq/asyncio: the
proxy, the instances and the simulator drive the same objects. Start with
:mod:`aegaeon_sched.actions` (the policy contract) and :func:`make_policy`.
"""

from aegaeon_sched.actions import (
    Action,
    Cancel,
    EnqueuePrefill,
    PlaceDecode,
    Policy,
    PolicyBase,
    Reject,
    RoleLoad,
    RunOnInstance,
)
from aegaeon_sched.aegaeon_policy import AegaeonPolicy
from aegaeon_sched.decode import DecodeBatch, DecodeDispatcher, DecodeWorkList
from aegaeon_sched.factory import POLICIES, ClusterSpec, PolicyOptions, make_policy
from aegaeon_sched.latency import (
    SHARED,
    DecodeSample,
    LatencyModel,
    ModelSpec,
    PrefillSample,
)
from aegaeon_sched.load_path import CHARGED_POLICIES, LoadPath, load_path_for
from aegaeon_sched.prefill import (
    MAX_GPSIZE,
    PrefillDispatcher,
    PrefillGroup,
    PrefillJob,
    PrefillQueue,
)
from aegaeon_sched.priority import CLASS_NAMES, SLOClass, SLOClasses, first_token_deadline_s
from aegaeon_sched.quota import (
    Q_MAX_S,
    ROUND_TTFT_FRACTION,
    BatchLoad,
    RoundPlan,
    RoundRobinPlanner,
    Turn,
)
from aegaeon_sched.request import InstanceId, NoInstance, Request
from aegaeon_sched.request_level import RequestLevelPolicy
from aegaeon_sched.request_pinned import PinnedRequestLevelPolicy
from aegaeon_sched.role_meter import RoleMeter
from aegaeon_sched.roles import RoleChange, RoleController, RoleSettings, RoleSignals
from aegaeon_sched.rounds import RoundController, ServedInRound, TurnEnd
from aegaeon_sched.share import DecodeShare
from aegaeon_sched.shedding import Shedder, Verdict
from aegaeon_sched.slo import (
    SLO,
    RequestTrace,
    SLOReport,
    artifact_qos,
    attainment,
    percentile,
    summarize,
    tokens_met,
)
from aegaeon_sched.static_mux import StaticMuxPolicy, place_models
from aegaeon_sched.velocity import Velocity, cluster_velocity

__all__ = [
    "CHARGED_POLICIES",
    "CLASS_NAMES",
    "MAX_GPSIZE",
    "POLICIES",
    "Q_MAX_S",
    "ROUND_TTFT_FRACTION",
    "SHARED",
    "SLO",
    "Action",
    "AegaeonPolicy",
    "BatchLoad",
    "Cancel",
    "ClusterSpec",
    "DecodeBatch",
    "DecodeDispatcher",
    "DecodeSample",
    "DecodeShare",
    "DecodeWorkList",
    "EnqueuePrefill",
    "InstanceId",
    "LatencyModel",
    "LoadPath",
    "ModelSpec",
    "NoInstance",
    "PinnedRequestLevelPolicy",
    "PlaceDecode",
    "Policy",
    "PolicyBase",
    "PolicyOptions",
    "PrefillDispatcher",
    "PrefillGroup",
    "PrefillJob",
    "PrefillQueue",
    "PrefillSample",
    "Reject",
    "Request",
    "RequestLevelPolicy",
    "RequestTrace",
    "RoleChange",
    "RoleController",
    "RoleLoad",
    "RoleMeter",
    "RoleSettings",
    "RoleSignals",
    "RoundController",
    "RoundPlan",
    "RoundRobinPlanner",
    "RunOnInstance",
    "SLOClass",
    "SLOClasses",
    "SLOReport",
    "ServedInRound",
    "Shedder",
    "StaticMuxPolicy",
    "Turn",
    "TurnEnd",
    "Velocity",
    "Verdict",
    "artifact_qos",
    "attainment",
    "cluster_velocity",
    "first_token_deadline_s",
    "load_path_for",
    "make_policy",
    "percentile",
    "place_models",
    "summarize",
    "tokens_met",
]
