"""Models added to a running instance (``AddModel``, model lifecycle): no restart.

On the compute thread (which owns the worker's specs and the latency model):
the model's spec is read from its checkpoint, the switcher learns it (its
weights come through the Model Cache at its first switch, as every model's)
and the latency model gets its Eq. 4-6 features (the shared fit covers it
until measured steps refine it). The answer, :class:`InstanceModels`, gives
the proxy the new KV capacities and profile. A model that cannot be read is
left out of the answer and logged; the proxy sees it missing.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import AddModel
from aegaeon_common.messages.report import InstanceModels
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_engine import CheckpointError
from aegaeon_sched import LatencyModel

from aegaeon_runtime.port import WorkerPort

log = get_logger("instance")


def add_model(worker: WorkerPort, latency: LatencyModel | None, msg: AddModel,
              incarnation: int = 0) -> InstanceModels:  # fmt: skip
    """Serve ``msg.name`` from now on (idempotent); the instance's models after it."""
    if msg.name not in worker.specs:
        try:
            spec = worker.add_model(msg.name, Path(msg.path))
        except (CheckpointError, OSError) as exc:
            log.error("model_add_failed", model=msg.name, path=msg.path, error=str(exc))
        else:
            if latency is not None:
                latency.specs[msg.name] = spec
            log.info("model_added", model=msg.name, path=msg.path)
    profile = (msgspec.convert(latency.to_dict(), LatencyProfile)
               if latency is not None else None)  # fmt: skip
    return InstanceModels(worker.kind, worker.index, incarnation, worker.capacity_tokens(),
                          profile)  # fmt: skip
