"""Proxy -> prefill instance (PUSH/PULL)."""

from __future__ import annotations

from aegaeon_common.messages.structs import SamplingParams
from aegaeon_common.wire import Channel, Message


class EnqueuePrefill(Message, frozen=True):
    """Put a request into group ``group_id`` of this instance's job queue (Alg. 1).

    The instance mirrors the proxy's view of its queue: a group id it has not
    seen opens a new group at ``group_key_s``, the place the proxy's copy gives
    the group (a group the instance emptied while this travelled, its running
    request done, reopens there rather than behind every group queued since).
    """

    TAG = "enqueue_prefill"
    request_id: str
    model: str
    group_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float  # proxy clock (time.time())
    # The instance process this is for (its hello's `incarnation`; 0: any). Its
    # successor drops it: work queued for a process that died is not redone twice.
    incarnation: int = 0
    # Many proxy replicas: where the instance sends this request's tokens (the
    # replica's report socket); "": the node's one proxy.
    reply_to: str = ""
    # SLO class (aegaeon_sched.priority: 0 interactive, 1 standard, 2 batch) and the
    # request's own targets (0: the deployment's): the queue's order on both sides.
    priority: int = 1
    ttft_s: float = 0.0
    tbt_s: float = 0.0
    # The group's key in the proxy's copy of the queue (None: the request's own
    # first-token deadline, where a new group opens).
    group_key_s: float | None = None


class CancelRequest(Message, frozen=True):
    """Stop work on a request and free everything it holds."""

    TAG = "cancel"
    request_id: str
    # Also free the KV handoff sent for it, if no decode instance claimed it: the
    # sender will never place it (a proxy replica that owns no cachemgr connection
    # to free it with, or the reaper of a dead replica). The single proxy frees
    # such handoffs itself and leaves this False.
    free_handoff: bool = False


class Shutdown(Message, frozen=True):
    """Finish nothing more; exit cleanly (the supervisor also sends SIGTERM)."""

    TAG = "shutdown"


class AckDrain(Message, frozen=True):
    """The proxy's answer to ``InstanceDraining``: it sends this instance no new
    work after this message (the channel is ordered), so once what it holds is
    done the instance may exit."""

    TAG = "ack_drain"
    pid: int  # the draining process (a restarted instance ignores an old ack)


class AddModel(Message, frozen=True):
    """Serve one more model (its checkpoint at ``path``) without a restart; the
    instance answers with ``InstanceModels`` (echoing ``ticket``), to ``reply_to``
    when set (a proxy replica: the instance has no default proxy), else to its
    proxy. Idempotent."""

    TAG = "add_model"
    name: str
    path: str
    ticket: int = 0
    reply_to: str = ""
    base: str = ""  # a LoRA adapter of this served model (``path``: its PEFT directory)


class ProxyStarted(Message, frozen=True):
    """A (single, non-distributed) proxy process started and sends this instance
    this before any work: the instance drops every request it holds from an
    earlier proxy (queued prefills, decode sequences with their KV, and the KV
    handoffs it sent that no decode instance has claimed). That proxy died with
    their clients; nobody else would end them. ``proxy``: the proxy process's
    random incarnation (a repeat of the same one is ignored). Proxy replicas
    sharing instances never send it."""

    TAG = "proxy_started"
    proxy: int


class SetModelAwake(Message, frozen=True):
    """Sleep or wake one model on this instance's device (the proxy's ``/sleep`` and
    ``/wake_up``, Ollama's ``keep_alive: 0``). ``awake=False``: drop it from the
    device now (its prefetch cancelled, or scaled down as the active model) unless
    work of it is queued here, which needs it; its bytes stay in the host Model
    Cache. ``awake=True``: switch it in now if the instance has no work, else
    prefetch it behind the active model. Answered with ``ModelsResident``."""

    TAG = "set_model_awake"
    name: str
    awake: bool
    ticket: int = 0  # echoed in the answer
    reply_to: str = ""  # where the answer goes (a proxy replica); "": the proxy


PREFILL_CHANNEL = Channel(
    "proxy->prefill",
    [EnqueuePrefill, CancelRequest, Shutdown, AckDrain, AddModel, ProxyStarted, SetModelAwake],
)
