"""Proxy -> decode instance (PUSH/PULL)."""

from __future__ import annotations

import msgspec

from aegaeon_common.messages.prefill import (
    AckDrain,
    AddModel,
    CancelRequest,
    EnqueuePrefill,
    ProxyStarted,
    SetModelAwake,
    Shutdown,
)
from aegaeon_common.messages.structs import KVHandoff, SamplingParams
from aegaeon_common.wire import Channel, Message


class EnqueueDecode(Message, frozen=True):
    """A prefilled request joins batch ``batch_id`` of its model (Alg. 2, line 2).

    On accepting it the instance takes over the handoff's blocks (lease) itself and
    frees them when the request ends (the proxy never touches the lease).
    """

    TAG = "enqueue_decode"
    request_id: str
    model: str
    batch_id: int
    prompt_len: int
    first_token_id: int
    num_generated: int  # tokens already produced (1: the prefill's)
    sampling: SamplingParams
    handoff: KVHandoff
    arrival_s: float
    # The instance process this is for (its hello's `incarnation`; 0: any). Its
    # successor drops it: work queued for a process that died is not redone twice.
    incarnation: int = 0
    # Many proxy replicas: where the instance sends this request's tokens (the
    # replica's report socket); "": the node's one proxy.
    reply_to: str = ""
    # SLO class and the request's own targets (0: the deployment's): a batch is
    # planned for its tightest TBT; tokens are held only while none is due.
    priority: int = 1
    ttft_s: float = 0.0
    tbt_s: float = 0.0
    # n > 1: every sequence's first token (sequence 0's is first_token_id) and those
    # that ended with it (they are not decoded); the prompt's KV is shared by them
    first_token_ids: list[int] = msgspec.field(default_factory=list)
    finished: list[int] = msgspec.field(default_factory=list)
    # the prompt, when the decode side needs it (a repetition penalty)
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)


class RunRequest(Message, frozen=True):
    """Request-level policies: prefill and decode the whole request here."""

    TAG = "run_request"
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    # The instance process this is for (its hello's `incarnation`; 0: any). Its
    # successor drops it: work queued for a process that died is not redone twice.
    incarnation: int = 0
    # Many proxy replicas: where the instance sends this request's tokens (the
    # replica's report socket); "": the node's one proxy.
    reply_to: str = ""


DECODE_CHANNEL = Channel(
    "proxy->decode",
    [EnqueueDecode, RunRequest, CancelRequest, Shutdown, AckDrain, AddModel, ProxyStarted,
     SetModelAwake],
)

# A hybrid instance: a prefill instance that decodes when it has no prefill work.
HYBRID_CHANNEL = Channel(
    "proxy->hybrid",
    [EnqueuePrefill, EnqueueDecode, RunRequest, CancelRequest, Shutdown, AckDrain, AddModel,
     ProxyStarted, SetModelAwake],
)
