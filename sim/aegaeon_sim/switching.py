"""What a model switch costs a simulated instance (its fake switcher's price list).

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

A simulated instance's switcher (:class:`aegaeon_sim.worker.FakeSwitcher`) asks
:func:`switch_cost` what each switch exposes, given the prefetch in flight.
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
