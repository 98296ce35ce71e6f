"""LoRA adapters in the simulator, as the live system serves them.

A market of ``per_model`` adapters over each model (rank ``rank`` on q, k, v, o):
a request names an adapter and carries its base as its switching unit
(``Request.unit``), so the policies group, batch and switch by the base as
they do live. An adapter's own matrices reach an instance once
(``aegaeon_sim.worker.SimAdapters``, the simulated worker's): the first time it
runs there, for Eq. 4 over its own bytes (megabytes, not a weight switch); they
stay, as on a live CPU worker (views over the Model Cache) and in a GPU's adapter
region until it fills.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
from aegaeon_sched import LatencyModel, Request

from aegaeon_sim.hardware import BYTES_PER_PARAM, Arch


def adapter_bytes(arch: Arch, rank: int) -> int:
    """A rank-``rank`` adapter on q, k, v, o: A ``[r, in]`` and B ``[out, r]`` per layer."""
    h, kv = arch.hidden, arch.kv_heads * arch.head_dim
    a = 4 * rank * h  # q, k, v read the hidden state; o reads the heads (as wide here)
    b = rank * (h + kv + kv + h)
    return arch.layers * (a + b) * BYTES_PER_PARAM


@dataclass(frozen=True)
class AdapterMarket:
    """Each adapter's base (``units``)."""

    units: dict[str, str]

    @property
    def names(self) -> list[str]:
        return list(self.units)


def adapter_market(models: dict[str, Arch], per_model: int, rank: int,
                   latency: LatencyModel) -> AdapterMarket:  # fmt: skip
    """``per_model`` adapters of every model, taught to ``latency``: a base's sizes and
    coefficients (its steps are the base's), its own bytes (its load)."""
    units: dict[str, str] = {}
    for base, arch in models.items():
        for k in range(per_model):
            name = f"{base}-lora{k}"
            units[name] = base
            latency.specs[name] = replace(latency.spec(base), name=name,
                                          weight_bytes=adapter_bytes(arch, rank))
            latency.set_prefill_coefficients(name, latency.prefill_coefficients(base))
            latency.set_decode_coefficients(name, latency.decode_coefficients(base))
    return AdapterMarket(units)


def with_units(requests: list[Request], market: AdapterMarket) -> list[Request]:
    """The requests of adapters with their bases as switching units."""
    return [msgspec.structs.replace(r, unit=market.units[r.model]) if r.model in market.units else r
            for r in requests]
