"""What a model switch costs a simulated instance, and the per-step/per-turn costs around it.

Two switch-cost models behind one protocol (:class:`Switching`):

- :class:`Eq4Switching`, the paper's hardware: a switch from the host costs
  Eq. 4 (``weight_bytes / PCIe * beta``); a switch to a model whose prefetch
  started ``e`` seconds ago costs what is left of Eq. 4 plus the on-device
  copy that promotes it to the front of the buffer (section 5.2).
- :class:`MeasuredSwitching`, a node whose switches were measured
  (:mod:`aegaeon_sim.node_costs`): a switch from the Model Cache costs
  ``fixed + bytes / rate`` fitted to the live switch records that were not
  prefetched; a prefetched one what is left of the background copy
  (``fixed + bytes / rate`` of the prefetch thread's copies) plus the
  measured cost of activating a model already in place.

:class:`InstanceCosts` bundles a switch model with the costs of a live
decode loop that the latency model (engine time only) does not see.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from aegaeon_sched import LatencyModel


class Switching(Protocol):
    def full_s(self, model: str) -> float:
        """A switch to ``model`` with nothing prefetched (critical path)."""
        ...

    def prefetched_s(self, model: str, elapsed_s: float) -> float:
        """A switch to ``model`` whose prefetch started ``elapsed_s`` ago (exposed part)."""
        ...


class Eq4Switching:
    """Eq. 4 and the on-device promotion of a prefetched model (see the module docstring)."""

    def __init__(self, latency: LatencyModel, d2d_bytes_per_s: float) -> None:
        self.latency = latency
        self.d2d_bytes_per_s = d2d_bytes_per_s

    def full_s(self, model: str) -> float:
        return self.latency.switch_s(model)

    def prefetched_s(self, model: str, elapsed_s: float) -> float:
        weights = self.latency.spec(model).weight_bytes
        return max(0.0, self.full_s(model) - elapsed_s) + weights / self.d2d_bytes_per_s


@dataclass(frozen=True)
class LinearCopy:
    """``fixed_s + nbytes / bytes_per_s``: a copy of a model's weights."""

    fixed_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class SwitchCosts:
    """Switch costs measured on one node (see :mod:`aegaeon_sim.node_costs`)."""

    load: LinearCopy  # critical path, from the Model Cache
    prefetch: LinearCopy  # the prefetch thread's background copy
    bind_s: float  # activating a model whose prefetch has completed
    num_records: int = 0  # switch records they were measured from (0: defaults)


class MeasuredSwitching:
    """Switches priced by :class:`SwitchCosts` (see the module docstring)."""

    def __init__(self, costs: SwitchCosts, weight_bytes: Mapping[str, int]) -> None:
        self.costs = costs
        self.weight_bytes = dict(weight_bytes)

    def full_s(self, model: str) -> float:
        return self.costs.load.seconds(self.weight_bytes[model])

    def prefetched_s(self, model: str, elapsed_s: float) -> float:
        copy_s = self.costs.prefetch.seconds(self.weight_bytes[model])
        return max(0.0, copy_s - elapsed_s) + self.costs.bind_s


def switch_cost(
    switching: Switching, model: str, prefetch: tuple[str, float] | None, now_s: float
) -> float:
    """The exposed cost of switching to ``model`` at ``now_s``; ``prefetch`` is
    ``(model, started_s)`` of the prefetch in flight, if any."""
    if prefetch is not None and prefetch[0] == model:
        return switching.prefetched_s(model, max(0.0, now_s - prefetch[1]))
    return switching.full_s(model)


@dataclass(frozen=True)
class InstanceCosts:
    """An instance's costs besides engine time (the latency model's Eq. 5-6).

    ``step_overhead_s``: wall time of a decode step beyond the engine's
    (sampling, bookkeeping, streaming the tokens out); ``turn_overhead_s``:
    a decode turn's fixed cost besides its switch (swap-in bookkeeping, the
    prefetch order); ``cold_step_s``: engine time added to the first step of a
    turn that began with a switch (the new model's weights are not in the
    caches and the next model's prefetch copy competes for memory bandwidth
    and cores); ``learned_switch_estimate``: the planner's switch
    estimate for a model is, as on the live decode instances
    (services/decode ``TurnRunner.switch_estimate``), the larger of Eq. 4 and
    a moving average (0.8/0.2) of its turns' time not spent in engine steps;
    otherwise Eq. 4 alone (the paper).
    """

    switching: Switching
    step_overhead_s: float = 0.0
    turn_overhead_s: float = 0.0
    cold_step_s: float = 0.0
    learned_switch_estimate: bool = False


class SwitchEstimate:
    """The switch estimates a decode planner uses (see :class:`InstanceCosts`)."""

    def __init__(self, latency: LatencyModel, learned: bool) -> None:
        self.latency = latency
        self.learned = learned
        self._overhead_s: dict[str, float] = {}

    def __call__(self, model: str) -> float:
        eq4 = self.latency.switch_s(model)
        return max(eq4, self._overhead_s.get(model, 0.0)) if self.learned else eq4

    def observe_turn(self, model: str, overhead_s: float) -> None:
        """A turn that decoded spent ``overhead_s`` outside engine steps."""
        old = self._overhead_s.get(model)
        self._overhead_s[model] = overhead_s if old is None else 0.8 * old + 0.2 * overhead_s
