"""What a scale-up costs a baseline that loads models as the paper's baselines did.

The paper's request-level baseline (ServerlessLLM) scales a model up by loading
its checkpoint over a load path (the paper's artifact charges ``bytes / 16
GB/s``; Fig. 7 measures 2.83 GB/s and up to 26.9 s of engine initialisation for
a 13B model in vLLM). ``request-level`` switches with this system's own
switcher (a copy from the Model Cache, no re-initialisation);
``request-level-charged`` is the same policy whose every scale-up takes at
least :meth:`LoadPath.scale_up_s`. The live instance waits out
:meth:`LoadPath.charge_s` after its real switch (and records it); the
simulator prices the switch at the larger of the two. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

CHARGED_POLICIES = ("request-level-charged",)
DEFAULT_LOAD_GB_S = 16.0  # the paper's artifact (25SOSP-Aegaeon, aegaeon/sim: PCIE = 16)


@dataclass(frozen=True)
class LoadPath:
    """A scale-up: ``init_s`` of engine start-up plus the weights at ``bytes_per_s``."""

    bytes_per_s: float
    init_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"a load path needs a positive rate, got {self.bytes_per_s}")
        if self.init_s < 0:
            raise ValueError(f"init_s must be >= 0, got {self.init_s}")

    @classmethod
    def of(cls, load_gb_s: float, init_s: float = 0.0) -> LoadPath:
        return cls(load_gb_s * 1e9, init_s)

    def scale_up_s(self, weight_bytes: int) -> float:
        """What loading ``weight_bytes`` of a model takes on this path."""
        return self.init_s + weight_bytes / self.bytes_per_s

    def charge_s(self, weight_bytes: int, measured_s: float) -> float:
        """What a scale-up that took ``measured_s`` still owes (0 when it took longer)."""
        return max(0.0, self.scale_up_s(weight_bytes) - measured_s)

    def switch_s(self, weight_bytes: int, measured_s: float) -> float:
        """A charged scale-up's whole time: the slower of the two."""
        return max(measured_s, self.scale_up_s(weight_bytes))


def load_path_for(policy: str, load_gb_s: float, init_s: float) -> LoadPath | None:
    """The load path ``policy``'s scale-ups pay; None for a policy that is not charged."""
    return LoadPath.of(load_gb_s, init_s) if policy in CHARGED_POLICIES else None
