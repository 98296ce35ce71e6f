"""Start-up profiles kept across runs: a worker measures its latency model once per machine.

A profile (profile.py) takes seconds to tens of seconds on a slow CPU, and
every start of every worker used to repeat it. What it measures depends only
on the machine (CPU model and features), torch's version, the engine's code
and kernel level, the worker's device, thread count, dtype and weight mode,
and the models' shapes: those make the key. The profile is kept as the
latency model's JSON under ``$XDG_CACHE_HOME/aegaeon/profiles/<key>.json``,
written atomically (a temporary file, then rename), and a worker whose key
is there loads it and only warms its engine up. The services refine the fit
online from every measured step either way, so a kept profile is a start,
not a verdict. ``AEGAEON_PROFILE_CACHE=0`` measures every time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import torch
from aegaeon_common.env import read_env
from aegaeon_common.kept import code_digest, cpu_identity, write_atomic
from aegaeon_common.logs import get_logger
from aegaeon_engine import DecodeSeq
from aegaeon_sched import LatencyModel

from aegaeon_runtime.port import ModelGoneError, WorkerPort
from aegaeon_runtime.profile import profile, profile_models
from aegaeon_runtime.worker import Worker, instance_config

log = get_logger("profile")

# Code whose change changes what a profile measures or how it is fitted.
_CODE_PACKAGES = ("aegaeon_engine", "aegaeon_runtime", "aegaeon_sched")


def profile_key(worker: Worker) -> str:
    """What a kept profile must agree on to be reused (see the module docstring)."""
    inst = instance_config(worker.config, worker.kind)
    device = worker.engine.device
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else cpu_identity())  # fmt: skip
    models = {name: [repr(spec), worker.switcher.nbytes(name)]  # frozen dataclass: every field
              for name, spec in sorted(worker.specs.items())}  # fmt: skip
    parts = {
        "machine": machine,
        "torch": torch.__version__,
        "code": code_digest(_CODE_PACKAGES),
        "isa": worker.engine.isa if device.type == "cpu" else None,
        "device": device.type,
        "threads": inst.threads,
        "dtype": worker.config.dtype,
        "weights": "map" if inst.maps_weights else "copy",
        "prefetch": worker.config.scheduler.prefetch,
        "tp": inst.tp,
        "models": models,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def warm_up(worker: Worker) -> None:
    """One prefill and one decode step of the smallest model: first-call costs paid now
    (none when no model's checkpoint could be read)."""
    readable = profile_models(worker)
    if not readable:
        return
    model = readable[0]
    try:
        worker.switcher.activate(model)
    except ModelGoneError:  # unreadable since the worker started: nothing to warm up
        return
    shape = worker.kv_shape(model)
    length = min(16, worker.max_model_len(model) - 1)
    blocks = worker.kv.alloc(shape, shape.blocks_for(length + 1))
    try:
        worker.engine.prefill([1] * length, blocks)
        worker.engine.decode([DecodeSeq(1, length, blocks)])
    finally:
        worker.kv.free(shape, blocks)


def cached_profile(worker: Worker, measure: Callable[[Worker], LatencyModel] = profile,
                   warm: Callable[[Worker], None] = warm_up) -> LatencyModel:
    """The kept profile for this worker's key (after ``warm(worker)``), else
    ``measure(worker)``, kept for next time."""
    env = read_env()
    if not env.profile_cache:
        return measure(worker)
    path = env.cache_dir / "profiles" / f"{profile_key(worker)}.json"
    try:
        latency = LatencyModel.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kept profile unreadable, measuring again", path=str(path), error=str(exc))
    else:
        if set(latency.specs) == set(worker.specs):
            warm(worker)
            log.info("start-up profile reused", path=str(path))
            return latency
    latency = measure(worker)
    try:
        write_atomic(path, json.dumps(latency.to_dict()))
    except OSError as exc:  # a read-only cache costs the next start a profile, nothing more
        log.warning("start-up profile not kept", path=str(path), error=str(exc))
    return latency


def start_up_profile(worker: WorkerPort) -> Callable[[], LatencyModel]:
    """A compute loop's latency model source: :func:`cached_profile` of a built
    worker (any other worker, e.g. a test's fake, must bring its own)."""
    if not isinstance(worker, Worker):
        raise TypeError("a worker other than aegaeon_runtime.worker.Worker needs a profile")
    return lambda: cached_profile(worker)
