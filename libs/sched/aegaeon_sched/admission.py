"""Admission: bounds on the work a node has accepted, checked before any work is spent.

Two quantities, each bounded per model and in total:

* **queued prefill tokens**: the prompt tokens of admitted requests whose
  first token has not come back yet (queued or prefilling);
* **KV blocks**: the blocks of 16 tokens of ``prompt + max_tokens`` each
  admitted request may fill by its end, reserved from admission until it ends.

A request that would take a quantity past its bound is refused with a 429
(and ``Retry-After``) unless nothing is admitted on that quantity yet, so a
request larger than a bound is served alone rather than never. Pure
bookkeeping: no clock, no I/O.

With SLO classes each class may fill its own fraction of every bound
(``fraction``; :mod:`aegaeon_sched.shedding` decides who is deferred or
refused past it: the lowest class first, never the highest first).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aegaeon_sched.latency import LatencyModel
from aegaeon_sched.request import Request
from aegaeon_sched.roles import TYPICAL_PROMPT_TOKENS
from aegaeon_sched.shedding import Shedder, Verdict

BLOCK_TOKENS = 16  # the engine's KV block size (aegaeon_engine.KVShape.block_size)

__all__ = ["BLOCK_TOKENS", "AdmissionControl", "Bounds", "ClassAdmission", "derive_bounds",
           "per_token_prefill_s"]


@dataclass(frozen=True)
class Bounds:
    """None: unbounded."""

    prefill_tokens: int | None = None
    prefill_tokens_per_model: int | None = None
    kv_blocks: int | None = None
    kv_blocks_per_model: int | None = None


def per_token_prefill_s(latency: LatencyModel, models: Iterable[str]) -> float:
    """An instance's slowest per-token prefill time over ``models`` (a typical prompt's)."""
    n = TYPICAL_PROMPT_TOKENS
    return max(latency.prefill_one_s(m, n) / n for m in models)


def derive_bounds(
    configured: Bounds,
    *,
    ttft_s: float,
    prefill_s_per_token: Iterable[float],
    decode_capacity_tokens: Iterable[Mapping[str, int]],
    host_kv_tokens: int = 0,
    replicas: int = 1,
) -> Bounds:
    """The configured bounds, the unset ones derived from the instances.

    Prefill: the tokens the prefill instances prefill within the TTFT target
    (``ttft_s`` over each instance's slowest per-token prefill time, summed):
    a request queued behind more would miss its TTFT anyway. KV: what the node
    holds of the model with the largest KV per token: the decode instances'
    device KV regions (each instance's smallest per-model capacity) plus the
    host's unified KV cache (``host_kv_tokens``), where the sequences of the
    models not running wait swapped out (§5.2) — a deployment's device regions
    alone hold a few requests per model, and the host cache is what lets many
    models' requests be open at once. With many proxy replicas each admits on its
    own: a derived bound is shared by the ``replicas`` evenly (a configured one is
    each replica's as configured). A per-model bound left unset is the total.
    """
    rates = [ttft_s / s for s in prefill_s_per_token if s > 0]
    prefill = configured.prefill_tokens
    if prefill is None and rates:
        prefill = max(1, int(sum(rates)) // max(1, replicas))
    kv = configured.kv_blocks
    capacities = [min(c.values()) // BLOCK_TOKENS for c in decode_capacity_tokens if c]
    if kv is None and capacities:
        kv = max(1, (sum(capacities) + host_kv_tokens // BLOCK_TOKENS) // max(1, replicas))
    return Bounds(
        prefill_tokens=prefill,
        prefill_tokens_per_model=configured.prefill_tokens_per_model or prefill,
        kv_blocks=kv,
        kv_blocks_per_model=configured.kv_blocks_per_model or kv,
    )


@dataclass(frozen=True)
class _Held:
    model: str
    prefill_tokens: int
    kv_blocks: int


class AdmissionControl:
    """What admitted requests hold; :meth:`refusal` says whether one more fits."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self._held: dict[str, _Held] = {}
        self._prefill: Counter[str] = Counter()  # model -> queued prefill tokens
        self._kv: Counter[str] = Counter()  # model -> reserved KV blocks
        self.refused: Counter[str] = Counter()  # reason -> requests refused

    @staticmethod
    def blocks(prompt_tokens: int, max_tokens: int) -> int:
        return -(-(prompt_tokens + max_tokens) // BLOCK_TOKENS)

    def refusal(self, model: str, prompt_tokens: int, max_tokens: int,
                fraction: float = 1.0, *, count: bool = True) -> str | None:  # fmt: skip
        """Why the request may not be admitted now under ``fraction`` x each bound,
        or None when it fits; ``count``: add a refusal to :attr:`refused`."""
        b = self.bounds
        blocks = self.blocks(prompt_tokens, max_tokens)
        checks = (
            ("prefill_tokens", sum(self._prefill.values()), prompt_tokens, b.prefill_tokens),
            ("prefill_tokens_per_model", self._prefill[model], prompt_tokens,
             b.prefill_tokens_per_model),
            ("kv_blocks", sum(self._kv.values()), blocks, b.kv_blocks),
            ("kv_blocks_per_model", self._kv[model], blocks, b.kv_blocks_per_model),
        )  # fmt: skip
        for name, held, wanted, full in checks:
            bound = None if full is None else max(1, int(full * fraction))
            if bound is not None and held > 0 and held + wanted > bound:
                if count:
                    self.refused[name] += 1
                return (f"{name.replace('_', ' ')}: {held} held + {wanted} asked > bound "
                        f"{bound}")  # fmt: skip
        return None

    def admit(self, request_id: str, model: str, prompt_tokens: int, max_tokens: int) -> None:
        held = _Held(model, prompt_tokens, self.blocks(prompt_tokens, max_tokens))
        self.release(request_id)
        self._held[request_id] = held
        self._prefill[model] += held.prefill_tokens
        self._kv[model] += held.kv_blocks

    def prefilled(self, request_id: str) -> None:
        """Its first token came back: its prompt leaves the prefill queue."""
        held = self._held.get(request_id)
        if held is not None and held.prefill_tokens:
            self._prefill[held.model] -= held.prefill_tokens
            self._held[request_id] = _Held(held.model, 0, held.kv_blocks)

    def requeued(self, request_id: str, prompt_tokens: int) -> None:
        """It goes back to the prefill queue (its instance failed before its first token)."""
        held = self._held.get(request_id)
        if held is not None:
            self._prefill[held.model] += prompt_tokens - held.prefill_tokens
            self._held[request_id] = _Held(held.model, prompt_tokens, held.kv_blocks)

    def release(self, request_id: str) -> None:
        """It ended (finished, failed, cancelled)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._prefill[held.model] -= held.prefill_tokens
            self._kv[held.model] -= held.kv_blocks

    def snapshot(self) -> dict[str, object]:
        """What is held and the bounds, for ``/v1/aegaeon/stats``."""
        return {
            "requests": len(self._held),
            "prefill_tokens": sum(self._prefill.values()),
            "kv_blocks": sum(self._kv.values()),
            "bounds": {
                "prefill_tokens": self.bounds.prefill_tokens,
                "prefill_tokens_per_model": self.bounds.prefill_tokens_per_model,
                "kv_blocks": self.bounds.kv_blocks,
                "kv_blocks_per_model": self.bounds.kv_blocks_per_model,
            },
            "refused": dict(self.refused),
        }


class ClassAdmission:
    """Admission by SLO class: each class may fill its own fraction of the bounds of
    ``admission``; past it a request is deferred (it waits here) or refused, as
    ``shedder`` (:class:`aegaeon_sched.Shedder`) says: the lowest class first, never
    the highest first. Without a shedder (classes off) every request is held to the
    whole bounds and refused past them, as before classes. Pure bookkeeping."""

    def __init__(self, admission: AdmissionControl, shedder: Shedder | None) -> None:
        self.admission = admission
        self.shedder = shedder

    def fits(self, request: Request, fraction: float) -> bool:
        """``request`` fits under ``fraction`` x each bound now (nothing counted)."""
        why = self.admission.refusal(request.model, request.prompt_len, request.max_tokens,
                                     fraction, count=False)  # fmt: skip
        return why is None

    def decide(self, request: Request) -> Verdict:
        """Admit, defer (kept by the shedder until :meth:`release`) or refuse."""
        if self.shedder is not None:
            return self.shedder.decide(request, self.fits)
        return Verdict.ADMIT if self.fits(request, 1.0) else Verdict.REFUSE

    def why(self, request: Request) -> str:
        """Why ``request`` was refused (counted in the admission's refusals)."""
        fraction = self.shedder.fraction(request) if self.shedder is not None else 1.0
        why = self.admission.refusal(request.model, request.prompt_len, request.max_tokens,
                                     fraction)  # fmt: skip
        if why is None and self.shedder is not None:
            why = f"{len(self.shedder)} requests of lower classes wait already"
        return why or "overloaded"

    def admit(self, request: Request) -> None:
        self.admission.admit(request.request_id, request.model, request.prompt_len,
                             request.max_tokens)  # fmt: skip

    def release(self) -> list[Request]:
        """Deferred requests that fit now, earliest deadline first, admitted one by one
        (each counts against the bounds before the next is tried): to dispatch."""
        if self.shedder is None:
            return []

        def fits_and_admit(request: Request, fraction: float) -> bool:
            if not self.fits(request, fraction):
                return False
            self.admit(request)
            return True

        return self.shedder.release(fits_and_admit)

    def expire(self, now_s: float) -> list[Request]:
        """Deferred requests whose wait ended (their first-token deadline passed)."""
        return self.shedder.expire(now_s) if self.shedder is not None else []

    def cancel(self, request_id: str) -> bool:
        """A deferred request went away (``False``: it was not waiting)."""
        return self.shedder.cancel(request_id) if self.shedder is not None else False

    @property
    def num_deferred(self) -> int:
        return len(self.shedder) if self.shedder is not None else 0
