"""SLO classes in the simulator (issue 19): the proxy's resolution, admission and shedding.

Nothing here decides anything the services decide differently: a request's
class is resolved into its own targets as the proxy does
(:meth:`aegaeon_sched.SLOClasses.default` of the deployment's SLO); admission
is the proxy's own :class:`~aegaeon_sched.admission.AdmissionControl`
with the bounds it derives (:func:`~aegaeon_sched.admission.derive_bounds`);
who is admitted, deferred or refused is :class:`aegaeon_sched.Shedder`'s call.
:class:`AdmissionGate` only sits where the proxy sits, in front of the policy:

- ``shedder`` given (SLO classes on): each arrival goes through
  :meth:`Shedder.decide <aegaeon_sched.Shedder.decide>` with ``fits`` = "the
  request fits under ``fraction`` x every admission bound" (the proxy's
  refusal rule on scaled bounds); a deferred request waits in the shedder and
  is released, earliest deadline first, whenever a prefill or a request ends;
  a refused one is a 429 (the simulator's :class:`~aegaeon_sched.Reject`).
- no shedder (the single-SLO scheduler): the proxy's admission at the bounds
  (fraction 1), past them a 429.

Attainment per class (:func:`reports_by_class`) scores each request against
its class's targets, whatever the scheduler knew of them: the single-SLO run
of a mixed trace is scored exactly as the multi-SLO one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from aegaeon_sched import (
    SLO,
    Action,
    InstanceId,
    Policy,
    Reject,
    Request,
    RequestTrace,
    Shedder,
    SLOClasses,
    SLOReport,
    Verdict,
    summarize,
)
from aegaeon_sched.admission import AdmissionControl, Bounds, ClassAdmission


def resolve(requests: Sequence[Request], classes: SLOClasses,
            class_of: Mapping[str, str]) -> list[Request]:  # fmt: skip
    """Each request with its class's rank and targets (what the proxy hands the policy)."""
    out = []
    for r in requests:
        c = classes.get(class_of[r.request_id])
        out.append(msgspec.structs.replace(r, priority=c.rank, ttft_s=c.ttft_s, tbt_s=c.tbt_s))
    return out


def class_slo(classes: SLOClasses, name: str) -> SLO:
    c = classes.get(name)
    return SLO(c.ttft_s, c.tbt_s)


def reports_by_class(
    traces: Sequence[RequestTrace], classes: SLOClasses, class_of: Mapping[str, str],
    *, tbt_percentiles: bool = False,
) -> dict[str, SLOReport]:  # fmt: skip
    """Attainment and latencies of each class's requests against its own targets."""
    groups: dict[str, list[RequestTrace]] = {}
    for t in traces:
        groups.setdefault(class_of[t.request_id], []).append(t)
    return {
        name: summarize(groups[name], class_slo(classes, name), tbt_percentiles=tbt_percentiles)
        for name in classes.names
        if name in groups
    }


class AdmissionGate:
    """The proxy's admission (and shedding by class) in front of ``policy``: a Policy."""

    def __init__(self, policy: Policy, bounds: Bounds, shedder: Shedder | None = None,
                 class_of: Mapping[str, str] | None = None) -> None:  # fmt: skip
        """``class_of``: request id -> class name, to count refusals by the class a
        request has even where the scheduler does not see it (single-SLO)."""
        self.policy = policy
        self.class_of = class_of or {}
        self.bounds = bounds
        self.admission = AdmissionControl(bounds)
        self.shedder = shedder
        self.gate = ClassAdmission(self.admission, shedder)  # the proxy's rule and verdict
        self.refused: Counter[str] = Counter()  # by class name
        self.deferred: Counter[str] = Counter()
        self.defer_wait_s: list[float] = []  # arrival -> admitted, of deferred requests

    def _admit(self, request: Request, now_s: float) -> list[Action]:
        self.gate.admit(request)
        return self.policy.on_arrival(request, now_s)

    def _release(self, now_s: float) -> list[Action]:
        if self.shedder is None or not len(self.shedder):
            return []
        actions: list[Action] = []
        for request in self.shedder.release(self.gate.fits):
            self.defer_wait_s.append(now_s - request.arrival_s)
            actions += self._admit(request, now_s)
        return actions

    def _class(self, request: Request) -> str:
        return self.class_of.get(request.request_id, str(request.priority))

    # ---- Policy ----------------------------------------------------------------
    def on_arrival(self, request: Request, now_s: float) -> list[Action]:
        verdict = self.gate.decide(request)
        if verdict is Verdict.ADMIT:
            return self._admit(request, now_s)
        if verdict is Verdict.DEFER:
            self.deferred[self._class(request)] += 1
            return []
        self.refused[self._class(request)] += 1
        return [Reject(request, "admission bounds (429)")]

    def on_prefill_done(
        self, instance: InstanceId, request_id: str, measured_s: float, now_s: float
    ) -> list[Action]:
        self.admission.prefilled(request_id)
        actions = self.policy.on_prefill_done(instance, request_id, measured_s, now_s)
        return actions + self._release(now_s)

    def on_request_finished(self, request_id: str, now_s: float) -> list[Action]:
        self.admission.release(request_id)
        actions = self.policy.on_request_finished(request_id, now_s)
        return actions + self._release(now_s)

    def on_request_cancelled(self, request_id: str, now_s: float) -> list[Action]:
        self.admission.release(request_id)
        if self.shedder is not None and self.shedder.cancel(request_id):
            return []
        return self.policy.on_request_cancelled(request_id, now_s)

    def __getattr__(self, name: str) -> Any:
        """The rest of the :class:`~aegaeon_sched.Policy` contract is the policy's own."""
        if name == "policy":  # not set yet (a copy being made): no recursion through here
            raise AttributeError(name)
        return getattr(self.policy, name)

    def snapshot(self) -> dict[str, object]:
        """Refused and deferred requests by class, the bounds, the deferral waits."""
        waits = sorted(self.defer_wait_s)
        return {
            "refused": dict(sorted(self.refused.items())),
            "deferred": dict(sorted(self.deferred.items())),
            "still_deferred": len(self.shedder) if self.shedder is not None else 0,
            "defer_wait_p50_s": waits[len(waits) // 2] if waits else 0.0,
            "defer_wait_max_s": waits[-1] if waits else 0.0,
            "bounds": {
                "prefill_tokens": self.bounds.prefill_tokens,
                "kv_blocks": self.bounds.kv_blocks,
            },
        }
