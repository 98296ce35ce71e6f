"""Static multiplexing baseline (MuxServe-like).

Models are placed on GPUs once, at most ``max_models_per_gpu`` (2) per GPU,
heaviest expected load first, each onto the GPU with the least expected load
so far among those with a free slot (and, when sizes are given, room for the
weights). A model's requests only ever go to its GPU; the co-located models
share that GPU's time with no switch cost (the instance interleaves their
iterations and admits requests as its KV room allows). Models that found no
slot cannot be served: their requests are rejected (``Reject`` code
``no_slot``: the live proxy answers 503 naming the placed models).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aegaeon_sched.actions import Action, Cancel, PolicyBase, Reject, RunOnInstance
from aegaeon_sched.request import InstanceId, Request


def place_models(
    instances: Sequence[InstanceId],
    model_loads: Mapping[str, float],
    *,
    max_models_per_gpu: int = 2,
    weight_bytes: Mapping[str, int] | None = None,
    gpu_weight_budget_bytes: int | None = None,
) -> dict[str, InstanceId]:
    """Static placement: model -> instance, for the models that fit."""
    placed: dict[InstanceId, list[str]] = {i: [] for i in instances}
    load: dict[InstanceId, float] = dict.fromkeys(instances, 0.0)
    used_bytes: dict[InstanceId, int] = dict.fromkeys(instances, 0)
    placement: dict[str, InstanceId] = {}
    # Heaviest first; the name breaks ties so the placement is reproducible.
    for model in sorted(model_loads, key=lambda m: (-model_loads[m], m)):
        size = (weight_bytes or {}).get(model, 0)
        candidates = [
            i
            for i in instances
            if len(placed[i]) < max_models_per_gpu
            and (gpu_weight_budget_bytes is None or used_bytes[i] + size <= gpu_weight_budget_bytes)
        ]
        if not candidates:
            continue
        target = min(candidates, key=lambda i: (load[i], len(placed[i])))
        placed[target].append(model)
        load[target] += model_loads[model]
        used_bytes[target] += size
        placement[model] = target
    return placement


class StaticMuxPolicy(PolicyBase):
    """Policy ``"static-mux"`` (see :mod:`aegaeon_sched.actions` for the contract)."""

    name = "static-mux"

    def __init__(
        self,
        instances: Sequence[InstanceId],
        model_loads: Mapping[str, float],
        *,
        max_models_per_gpu: int = 2,
        weight_bytes: Mapping[str, int] | None = None,
        gpu_weight_budget_bytes: int | None = None,
    ) -> None:
        self.placement = place_models(
            instances,
            model_loads,
            max_models_per_gpu=max_models_per_gpu,
            weight_bytes=weight_bytes,
            gpu_weight_budget_bytes=gpu_weight_budget_bytes,
        )
        self._instance_of: dict[str, InstanceId] = {}

    def models_on(self, instance: InstanceId) -> list[str]:
        return [m for m, i in self.placement.items() if i == instance]

    def on_arrival(self, request: Request, now_s: float) -> list[Action]:
        instance = self.placement.get(request.switch_unit)  # an adapter goes with its base
        if instance is None:
            placed = ", ".join(sorted(self.placement)) or "none"
            return [Reject(request, f"model {request.model!r} has no instance slot under "
                           f"static multiplexing (the models resident on the instances: "
                           f"{placed})", code="no_slot")]
        self._instance_of[request.request_id] = instance
        return [RunOnInstance(instance, request, request.switch_unit)]

    def on_request_finished(self, request_id: str, now_s: float) -> list[Action]:
        self._instance_of.pop(request_id, None)
        return []

    def on_request_cancelled(self, request_id: str, now_s: float) -> list[Action]:
        instance = self._instance_of.pop(request_id, None)
        return [Cancel(instance, request_id)] if instance is not None else []

    def state(self) -> dict[str, Any]:
        return {"bound": dict(self._instance_of)}

    def restore_state(self, state: dict[str, Any]) -> None:
        self._instance_of = {str(k): str(v) for k, v in state["bound"].items()}
