"""The request table: every request the proxy backend holds, its admission by SLO
class (:mod:`aegaeon_sched.admission`), stream, end, failure and retries; the
backend gives only the :class:`Placement`.

Invariants: a request is in :attr:`RequestTable.requests` from its admission
(or deferral) until it ends, exactly once; an ended id is remembered for a
while (:data:`RECENT_IDS`) so its late tokens are not taken for a stranger's.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from typing import Protocol

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.report import PrefillDone, StepTokens
from aegaeon_common.messages.structs import RequestTimings
from aegaeon_common.registry import InstanceRecord
from aegaeon_common.wire import to_plain
from aegaeon_sched import LatencyModel, Request, Shedder, Verdict
from aegaeon_sched.admission import (
    AdmissionControl,
    Bounds,
    ClassAdmission,
    derive_bounds,
    per_token_prefill_s,
)

from aegaeon_proxy.backend import BackendError, GenerationRequest, TokenQueue
from aegaeon_proxy.cluster.tracked import Tracked, deliver, merge_timings
from aegaeon_proxy.slo_classes import class_table
from aegaeon_proxy.vllm_metrics import EngineSteps

log = get_logger("cluster")

__all__ = ["MAX_RETRIES", "RECENT_IDS", "Placement", "RequestTable", "bounds_of", "make_shedder"]

MAX_RETRIES = 2  # dispatches again of a request whose instance failed before its first token
RECENT_IDS = 4096  # request ids ended lately (their late tokens are expected)
# (the backend's events too: its reports, the store, the instances and replicas lost)
COUNTERS = ("finished", "failed", "cancelled", "retried", "rejected", "deferred",
            "orphans_cancelled", "bad_frames", "report_errors", "orphan_tokens", "reaped",
            "instances_lost", "store_errors", "store_losses")  # fmt: skip


class Placement(Protocol):
    """Where requests go and how that is undone (the backend's part)."""

    def place(self, tracked: Tracked) -> None:
        """``tracked`` was admitted: send it to an instance (or hold it for one)."""

    def replace(self, tracked: Tracked) -> None:
        """``tracked``'s instance failed before its first token: place it again."""

    def unplace(self, tracked: Tracked, cancelled: bool) -> None:
        """``tracked`` ended (``cancelled``: by its client) after it was placed: what
        the placement holds of it goes (at its instance too when cancelled)."""

    def cancel_orphan(self, request_id: str, msg: StepTokens) -> None:
        """Tokens of ``request_id``, which this proxy never knew (it restarted while the
        request ran), came in ``msg``: cancel it at the instance that sent them."""


def make_shedder(config: Config) -> Shedder | None:
    """Shedding by SLO class: under overload the lowest class is deferred or refused
    first. With ``proxy.admission_wait`` a request past the bounds (its class's share
    of them) waits its turn until its first-token deadline instead of a 429 at once;
    classes off: one class at the whole bounds. None: classes off and no waiting."""
    wait = config.proxy.admission_wait
    max_wait_s = config.proxy.admission_max_wait_s if wait else None
    if config.slo_classes.enabled:
        max_deferred = config.slo_classes.max_deferred
        if wait:  # as many as may be open
            max_deferred = max(max_deferred, config.proxy.max_queued_requests)
        return Shedder(class_table(config, config.slo.ttft_s, config.slo.tbt_s),
                       max_deferred, wait_all=wait, max_wait_s=max_wait_s)  # fmt: skip
    if wait:
        return Shedder.one_class(config.slo.ttft_s, config.slo.tbt_s,
                                 config.proxy.max_queued_requests, max_wait_s)  # fmt: skip
    return None


def bounds_of(config: Config, records: Iterable[InstanceRecord], replicas: int = 1) -> Bounds:
    """``proxy.max_*`` bounds, the unset ones derived from the instances' ``records``
    (:func:`~aegaeon_sched.admission.derive_bounds`: prefill within the TTFT target, the
    decode instances' KV plus each node's host KV cache). With many proxy replicas,
    each admits on its own: a derived bound is shared by the ``replicas`` evenly (a
    configured one is each replica's as configured)."""
    proxy = config.proxy
    per_token: list[float] = []
    capacities: list[dict[str, int]] = []
    host_kv_tokens: dict[str, int] = {}  # node -> its host KV cache in tokens
    for m in records:
        prefills = config.unified or m.kind == "prefill"
        if prefills and m.latency is not None and m.capacity_tokens:
            latency = LatencyModel.from_dict(to_plain(m.latency))
            per_token.append(per_token_prefill_s(latency, m.capacity_tokens))
        if config.unified or m.kind == "decode" or config.hybrid_prefill:  # it decodes
            capacities.append(dict(m.capacity_tokens))
            if m.capacity_tokens:
                # the host KV cache in tokens of the same (largest per-token) model:
                # the device region scaled by the two regions' sizes
                region = (config.decode if m.kind == "decode" else config.prefill).kv_memory_bytes
                tokens = min(m.capacity_tokens.values()) * config.cache.kv_cache_bytes // region
                host_kv_tokens[m.node] = max(host_kv_tokens.get(m.node, 0), tokens)
    configured = Bounds(proxy.max_prefill_tokens, proxy.max_prefill_tokens_per_model,
                        proxy.max_kv_blocks, proxy.max_kv_blocks_per_model)  # fmt: skip
    return derive_bounds(configured, ttft_s=config.slo.ttft_s, prefill_s_per_token=per_token,
                         decode_capacity_tokens=capacities, replicas=replicas,
                         host_kv_tokens=sum(host_kv_tokens.values()))  # fmt: skip


class RequestTable:
    """See the module. Runs on the proxy's event loop; nothing here blocks or awaits."""

    def __init__(self, config: Config, placement: Placement) -> None:
        self.config = config
        self.placement = placement
        self.requests: dict[str, Tracked] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # where each ended request's time went (the Fig. 14 breakdown), for the stats
        self.timings: deque[dict[str, object]] = deque(maxlen=config.proxy.stats_records)
        self.steps = EngineSteps()  # vllm:iteration_tokens_total, from the reports
        self.shedder = make_shedder(config)
        self.admission: AdmissionControl | None = None  # once bounds are known
        self.gate: ClassAdmission | None = None  # the admission by SLO class, with it
        # ids ended here lately, oldest first: tokens of an id not in here and not
        # open belong to a request this proxy never knew
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._releasing = False

    def set_bounds(self, bounds: Bounds) -> None:
        if self.admission is None:
            self.admission = AdmissionControl(bounds)
            self.gate = ClassAdmission(self.admission, self.shedder)
        else:
            self.admission.bounds = bounds
        self.release_deferred()

    # ---- arrivals ------------------------------------------------------------
    def open(self, req: GenerationRequest) -> Tracked:
        """Admit ``req`` and place it, defer it (it waits here for room), or raise a
        ``BackendError`` (429) past the bounds."""
        retry_after_s = self.config.proxy.retry_after_s
        limit = self.config.proxy.max_queued_requests
        if req.request_id in self.requests:  # a client's X-Request-Id used twice at once
            raise BackendError(f"a request with id '{req.request_id}' is in flight already",
                               status=409, code="duplicate_request_id")  # fmt: skip
        if len(self.requests) >= limit:
            self.counters["rejected"] += 1
            raise BackendError.overloaded(
                f"{len(self.requests)} requests in flight at this proxy (limit {limit})",
                retry_after_s=retry_after_s,
            )  # fmt: skip
        s = req.sampling
        sched = Request(
            req.request_id, req.model, req.arrival_s, len(req.prompt_token_ids), s.max_tokens,
            oracle_output_len=s.max_tokens if s.ignore_eos else None,
            priority=req.priority, ttft_s=req.ttft_s, tbt_s=req.tbt_s, unit=req.unit,
        )  # fmt: skip
        verdict = self.gate.decide(sched) if self.gate is not None else Verdict.ADMIT
        if verdict is Verdict.REFUSE:
            assert self.gate is not None
            self.counters["rejected"] += 1
            raise BackendError.overloaded(
                f"this proxy is at its admission bound for {req.slo_class} requests "
                f"({self.gate.why(sched)}); retry later", retry_after_s=retry_after_s,
            )  # fmt: skip
        tracked = Tracked(req, sched, TokenQueue())
        self.requests[req.request_id] = tracked
        if verdict is Verdict.DEFER:  # it waits here for room (release_deferred)
            tracked.deferred = True
            tracked.queue.hold()  # the front answers once it is admitted or refused
            self.counters["deferred"] += 1
            log.debug("request_deferred", request_id=req.request_id, model=req.model,
                      slo_class=req.slo_class)  # fmt: skip
            return tracked
        self._place(tracked)
        return tracked

    def _place(self, tracked: Tracked, admitted: bool = False) -> None:
        if not admitted and self.gate is not None:
            self.gate.admit(tracked.sched)
        tracked.queue.admit()
        self.placement.place(tracked)

    def release_deferred(self) -> None:
        """Room was freed: deferred requests that fit now go out, earliest deadline first."""
        gate = self.gate
        if gate is None or self._releasing or not gate.num_deferred:
            return
        self._releasing = True  # placing may end requests: no re-entry
        try:
            while gate.num_deferred and (released := gate.release()):
                for sched in released:
                    tracked = self.requests.get(sched.request_id)
                    if tracked is not None and tracked.deferred:
                        tracked.deferred = False
                        self._place(tracked, admitted=True)
                    elif self.admission is not None:  # gone meanwhile
                        self.admission.release(sched.request_id)
        finally:
            self._releasing = False

    def expire_deferred(self, now_s: float) -> None:
        """Deferred requests whose first-token deadline passed while they waited: they
        can no longer meet it, and are refused now (429, Retry-After)."""
        if self.gate is None:
            return
        for sched in self.gate.expire(now_s):
            tracked = self.requests.pop(sched.request_id, None)
            if tracked is None:
                continue
            self._forget(sched.request_id)
            self.counters["rejected"] += 1
            max_wait_s = self.config.proxy.admission_max_wait_s
            waited = (f"its time to first token ({sched.ttft_s or self.config.slo.ttft_s:g} s"
                      if max_wait_s is None else f"proxy.admission_max_wait ({max_wait_s:g} s")
            tracked.queue.refuse(BackendError.overloaded(
                f"this proxy had no room for this request within {waited}; it waited for "
                "room at the admission bounds); retry later",
                retry_after_s=self.config.proxy.retry_after_s,
            ))  # fmt: skip

    # ---- ends ----------------------------------------------------------------
    def end(self, request_id: str, reason: str, error: str | None = None,
            code: str | None = None, cancelled: bool = False) -> None:  # fmt: skip
        """The request is over (finished, failed: ``reason`` "error", or ``cancelled``: its
        client went away): undo its placement (at its instance too when cancelled),
        close its stream."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return
        self._forget(request_id)
        self.counters["cancelled" if cancelled else "failed" if reason == "error"
                      else "finished"] += 1  # fmt: skip
        if cancelled:
            self._timed(tracked, "cancelled", None)
        if tracked.deferred:
            if self.gate is not None:
                self.gate.cancel(request_id)  # it never was placed
        else:
            self.placement.unplace(tracked, cancelled)
        if cancelled or reason == "error":
            tracked.queue.finish("cancelled" if cancelled else "error", error, code)
        self.release_deferred()

    def _forget(self, request_id: str) -> None:
        if self.admission is not None:
            self.admission.release(request_id)
        self._ended[request_id] = None
        if len(self._ended) > RECENT_IDS:
            self._ended.popitem(last=False)

    def _timed(self, tracked: Tracked, reason: str, timings: RequestTimings | None) -> None:
        gen = tracked.gen
        self.timings.append({
            "request_id": gen.request_id, "model": gen.model, "arrival_s": gen.arrival_s,
            "finish_reason": reason, "num_tokens": tracked.num_generated,
            **to_plain(merge_timings(tracked.prefill_timings, timings)),
        })  # fmt: skip

    # ---- reports -------------------------------------------------------------
    def prefilled(self, msg: PrefillDone, owner: str) -> Tracked | None:
        """A first token and its KV handoff (leased to ``owner``): delivered, its prompt
        out of the admission's prefill tokens. None: not a request waiting for its
        first token here (cancelled meanwhile, or a second prefill of it): the caller
        sees the handoff freed."""
        tracked = self.requests.get(msg.request_id)
        if tracked is None or tracked.num_generated > 0:
            return None
        if self.admission is not None:
            self.admission.prefilled(msg.request_id)
        firsts = [msg.token_id, *msg.sibling_token_ids]
        finishes = [msg.finish_reason, *msg.sibling_finish_reasons]
        tracked.num_generated = len(firsts)
        tracked.handoff_owner = owner
        tracked.first_token_id = msg.token_id
        if len(firsts) > 1:
            tracked.first_token_ids = firsts
            tracked.finished_first = [i for i, f in enumerate(finishes) if f is not None]
        tracked.handoff = msg.handoff
        tracked.prefill_timings = msg.timings
        self.steps.prefill(tracked.gen.model, len(tracked.gen.prompt_token_ids))
        logprobs = msg.logprobs if len(msg.logprobs) == len(firsts) else []
        for i, (token_id, finish) in enumerate(zip(firsts, finishes, strict=True)):
            deliver(tracked, (token_id,), finish, index=i, logprobs=logprobs[i:i + 1],
                    prompt_logprobs=msg.prompt_logprobs if i == 0 else None)
        self.release_deferred()
        return tracked

    def finish_first(self, tracked: Tracked, msg: PrefillDone) -> bool:
        """Every sequence ended with its first token: end the request; True if so."""
        if tracked.open_seqs:
            return False
        reason = msg.finish_reason or "stop"
        self._timed(tracked, reason, msg.timings)
        self.end(msg.request_id, reason)
        return True

    def step_tokens(self, msg: StepTokens) -> None:
        """One decode report's tokens, each to its request's stream (the ends ended), and
        as one batch's steps (one model) to ``vllm:iteration_tokens_total``. Tokens of an
        id neither open nor ended lately are a stranger's: cancelled where they came from."""
        model, counts = "", list[int]()
        for item in msg.items:
            tracked = self.requests.get(item.request_id)
            if tracked is None:
                if item.finish_reason is None and item.request_id not in self._ended:
                    self._forget(item.request_id)
                    self.counters["orphans_cancelled"] += 1
                    log.info("orphan_cancelled", request_id=item.request_id, index=msg.index)
                    self.placement.cancel_orphan(item.request_id, msg)
                continue
            model = tracked.gen.model
            counts.append(len(item.token_ids))
            tracked.num_generated += len(item.token_ids)
            reason = item.finish_reason
            if deliver(tracked, item.token_ids, reason, item.timings, index=item.index,
                       logprobs=item.logprobs):
                assert reason is not None
                self._timed(tracked, reason, item.timings)
                self.end(item.request_id, reason)
        if counts:
            self.steps.decode(model, counts)

    def failed(self, request_id: str, instance: str, code: str, message: str) -> None:
        """``instance`` could not serve the request: it ends with that error (and its
        code; ``model_unavailable``'s message is the checkpoint's error alone)."""
        tracked = self.requests.get(request_id)
        if tracked is None:
            return
        self._timed(tracked, "error", None)
        log.warning("request_failed", request_id=request_id, model=tracked.gen.model,
                    instance=instance, code=code, error=message)  # fmt: skip
        error = message if code == "model_unavailable" else f"{instance}: {code}: {message}"
        self.end(request_id, "error", error, code=code)

    def lost(self, tracked: Tracked, instance: str, why: str) -> None:
        """``tracked``'s instance failed: placed again when it had no token yet (up to
        ``MAX_RETRIES`` times), else it ends with ``instance_failed``."""
        request_id = tracked.gen.request_id
        if self.requests.get(request_id) is not tracked:
            return  # it ended meanwhile (another's end released room and placed work)
        if tracked.num_generated == 0 and tracked.retries < MAX_RETRIES:
            tracked.retries += 1
            self.counters["retried"] += 1
            if self.admission is not None:
                self.admission.requeued(request_id, len(tracked.gen.prompt_token_ids))
            log.info("request_retried", request_id=request_id, model=tracked.gen.model,
                     instance=instance, attempt=tracked.retries)  # fmt: skip
            self.placement.replace(tracked)
            return
        log.warning("request_lost", request_id=request_id, model=tracked.gen.model,
                    instance=instance, error=why)  # fmt: skip
        self.end(request_id, "error", why, code="instance_failed")

    # ---- observability -------------------------------------------------------
    def classes_snapshot(self) -> dict[str, object]:
        by_class = Counter(t.gen.slo_class for t in self.requests.values())
        out: dict[str, object] = {"enabled": self.config.slo_classes.enabled,
                                  "open_by_class": dict(by_class)}  # fmt: skip
        if self.shedder is not None:
            out["shedding"] = self.shedder.snapshot()
        return out
