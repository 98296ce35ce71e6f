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
    Reject,
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
from aegaeon_sched.prefill import (
    MAX_GPSIZE,
    PrefillDispatcher,
    PrefillGroup,
    PrefillJob,
    PrefillQueue,
)
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
from aegaeon_sched.rounds import RoundController, ServedInRound, TurnEnd
from aegaeon_sched.share import DecodeShare
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

__all__ = [
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
    "ModelSpec",
    "NoInstance",
    "PinnedRequestLevelPolicy",
    "PlaceDecode",
    "Policy",
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
    "RoundController",
    "RoundPlan",
    "RoundRobinPlanner",
    "RunOnInstance",
    "SLOReport",
    "ServedInRound",
    "StaticMuxPolicy",
    "Turn",
    "TurnEnd",
    "artifact_qos",
    "attainment",
    "make_policy",
    "percentile",
    "place_models",
    "summarize",
    "tokens_met",
]
