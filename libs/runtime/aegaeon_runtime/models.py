"""Models added to a running instance (``AddModel``, model lifecycle): no restart;
and models put to sleep or woken on its device (``SetModelAwake``).

On the compute thread (which owns the worker's specs and the latency model):
the model's spec is read from its checkpoint, the switcher learns it (its
weights come through the Model Cache at its first switch, as every model's)
and the latency model gets its Eq. 4-6 features (the shared fit covers it
until measured steps refine it). The answer, :class:`InstanceModels`, gives
the proxy the new KV capacities and profile. A model that cannot be read is
left out of the answer and logged; the proxy sees it missing.

A sleeping model is off the device (``ModelSwitcher.evict``) and still in the
host Model Cache; work of it queued here keeps it (the work needs it), and a
request that comes later switches it back in as any switch does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import AddModel, SetModelAwake
from aegaeon_common.messages.report import InstanceModels, ModelsResident
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.transport import RemoteError
from aegaeon_engine import CheckpointError
from aegaeon_sched import LatencyModel

from aegaeon_runtime.port import ModelGoneError, WorkerPort

log = get_logger("instance")


def add_model(worker: WorkerPort, latency: LatencyModel | None, msg: AddModel,
              incarnation: int = 0) -> InstanceModels:  # fmt: skip
    """Serve ``msg.name`` from now on (idempotent); the instance's models after it."""
    if msg.name not in worker.specs:
        try:
            spec = worker.add_model(msg.name, Path(msg.path), msg.base or None)
        except (CheckpointError, OSError) as exc:
            log.error("model_add_failed", model=msg.name, path=msg.path, error=str(exc))
        else:
            if latency is not None:
                latency.specs[msg.name] = spec
            log.info("model_added", model=msg.name, path=msg.path)
    profile = (msgspec.convert(latency.to_dict(), LatencyProfile)
               if latency is not None else None)  # fmt: skip
    return InstanceModels(worker.kind, worker.index, incarnation, worker.capacity_tokens(),
                          profile, ticket=msg.ticket, reply_to=msg.reply_to)  # fmt: skip


def set_awake(
    worker: WorkerPort, msg: SetModelAwake, busy: Callable[[str], bool], idle: bool
) -> ModelsResident:
    """Sleep or wake ``msg.name`` on this device (on the compute thread, between two
    steps). ``busy(model)``: work of it is queued here; ``idle``: no work at all. A
    LoRA adapter's sleep takes its matrices off the device (its base stays); its wake
    brings its base in as a woken model comes, the adapter with it."""
    switcher = worker.switcher
    name = msg.name
    if name in worker.specs:
        unit = worker.unit_of(name)
        adapter = unit != name
        if not msg.awake:
            evict = worker.adapters.evict if adapter else switcher.evict
            if not busy(name) and evict(name):
                log.info("model_asleep", model=name)
        else:
            try:
                loading = unit not in switcher.resident_models()
                if loading and idle:
                    switcher.activate(unit)  # the weights come in now
                elif loading:
                    switcher.prefetch(unit)  # behind the active model, if it fits
                if adapter and switcher.active_model == unit:
                    worker.adapters.for_step([name])
                if adapter:
                    log.info("model_awake", model=name, base=unit)
                elif loading:
                    log.info("model_awake", model=name, loaded=idle)
            except (RemoteError, TimeoutError, OSError, ModelGoneError) as exc:  # its load
                log.error("model_wake_failed", model=name, error=str(exc))
    return ModelsResident(worker.kind, worker.index, msg.ticket,
                          worker.adapters.with_adapters(switcher.resident_models()),
                          switcher.residency_version + worker.adapters.version,
                          reply_to=msg.reply_to)  # fmt: skip
