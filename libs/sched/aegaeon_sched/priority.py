"""SLO classes and priorities: requests of one model with different targets (past the paper).

The paper gives every request of a model the same SLO. Multi-SLO serving
(HyperFlexis §5) lets a request carry a class or its own targets. Here a
request names one of three classes (``priority``: ``interactive``,
``standard``, ``batch``; rank 0 is the highest) or explicit ``ttft_s`` /
``tbt_s``; the proxy resolves both into the request's own targets
(:attr:`Request.ttft_s <aegaeon_sched.request.Request.ttft_s>`, ``tbt_s``)
before the policy sees it. What each part of the scheduler does with them:

- **Prefill (Algorithm 1)**: groups hold one model *and one class*; a group
  stands in its instance's queue at the first-token deadline of the request
  that opened it (:func:`first_token_deadline_s`), and the queue runs the
  earliest deadline first (:class:`~aegaeon_sched.prefill.PrefillQueue`).
  With one class every key is ``arrival + TTFT``: the paper's FIFO of groups.
  Nothing starves: a request waits only behind groups whose keys are
  earlier than its own, so a ``batch`` request arriving at ``t`` runs before
  any ``interactive`` request arriving after ``t + TTFT_batch -
  TTFT_interactive``, except those joining an interactive group opened
  before that (at most ``MAX_GPSIZE - 1`` per group), and after the prefill
  running then: its wait is bounded however long a flood of urgent requests
  lasts (``tests/unit/test_sched_priority.py``).
- **Decode (Eq. 2-3)**: a batch is planned for the tightest TBT of its
  requests (:attr:`~aegaeon_sched.decode.DecodeBatch.tbt_s`).
- **Admission**: under overload the lowest class is shed first
  (:mod:`aegaeon_sched.shedding`): each class may fill its own fraction of
  the node's admission bounds, the highest class more than the others.

Pure data and arithmetic; the defaults scale the deployment's SLO.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegaeon_sched.request import Request

INTERACTIVE, STANDARD, BATCH = 0, 1, 2
CLASS_NAMES = ("interactive", "standard", "batch")  # by rank
DEFAULT_CLASS = "standard"

# Default targets as multiples of the deployment's (TTFT, TBT): an interactive
# request wants its first token in half the time; a batch request tolerates 5x
# the TTFT and 4x the TBT (HyperFlexis's task mix spans 0.7-20 s TTFT, 0.2-1 s TPOT).
DEFAULT_FACTORS: dict[str, tuple[float, float]] = {
    "interactive": (0.5, 1.0),
    "standard": (1.0, 1.0),
    "batch": (5.0, 4.0),
}
# The share of each admission bound a class may fill before its requests are shed:
# the highest class has headroom beyond the bound, the lowest sheds at half of it.
DEFAULT_ADMIT_FRACTIONS: dict[str, float] = {"interactive": 1.25, "standard": 1.0, "batch": 0.5}
DEFAULT_DEFER: dict[str, bool] = {"interactive": False, "standard": False, "batch": True}


@dataclass(frozen=True)
class SLOClass:
    """One class: its targets and how it is shed under overload."""

    name: str
    rank: int  # 0 is the highest
    ttft_s: float
    tbt_s: float
    admit_fraction: float = 1.0  # of each admission bound (see aegaeon_sched.shedding)
    defer: bool = False  # past it: wait for room (True) or be refused (False)


@dataclass(frozen=True)
class SLOClasses:
    """The classes of a deployment, by rank (0 first)."""

    classes: tuple[SLOClass, ...]

    def __post_init__(self) -> None:
        if [c.rank for c in self.classes] != list(range(len(self.classes))):
            raise ValueError("classes must be listed by rank, 0 first")
        for c in self.classes:
            if c.ttft_s <= 0 or c.tbt_s <= 0 or c.admit_fraction <= 0:
                raise ValueError(f"class {c.name!r}: targets and admit_fraction must be > 0")

    @classmethod
    def default(cls, ttft_s: float, tbt_s: float) -> SLOClasses:
        """The three classes with the default factors of the deployment's SLO."""
        return cls(tuple(
            SLOClass(name, rank, ttft_s * DEFAULT_FACTORS[name][0],
                     tbt_s * DEFAULT_FACTORS[name][1], DEFAULT_ADMIT_FRACTIONS[name],
                     DEFAULT_DEFER[name])
            for rank, name in enumerate(CLASS_NAMES)
        ))  # fmt: skip

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def lowest_rank(self) -> int:
        return len(self.classes) - 1

    def get(self, name: str) -> SLOClass:
        """The class called ``name``; KeyError if there is none."""
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def by_rank(self, rank: int) -> SLOClass:
        return self.classes[min(max(rank, 0), self.lowest_rank)]


def first_token_deadline_s(request: Request, default_ttft_s: float = 0.0) -> float:
    """When the request's first token is due: ``arrival + TTFT`` (its own, else the default).

    Also the key that orders prefill work (earliest first): with one TTFT for
    every request this is arrival order.
    """
    ttft = request.ttft_s if request.ttft_s is not None else default_ttft_s
    return request.arrival_s + ttft
