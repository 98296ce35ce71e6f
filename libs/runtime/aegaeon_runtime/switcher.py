"""Model switching in a worker: scale-down is a pointer move, scale-up one flat copy.

The worker's weights arena (the bottom of its :class:`DeviceBuffer`) holds the
active model and, right after it, at most one prefetched model. Nothing is
re-initialised on a switch (paper §5.1): the engine, its kernels, rope tables,
the sampler and every buffer stay; only the engine's weight views change.

- **Scale-up from the Model Cache**: reset the bump pointer (scale-down: no
  free, no garbage collection), copy the model's packed bytes from its
  shared-memory region with a chunked copy, bind views. The region's mapping
  is kept by the cache client after the first scale-up, so later ones copy
  from it with no round trip to the cachemgr on the critical path (the use
  is reported later by the client); the views bound over an arena
  offset are kept too, so a model coming back to the same place is bound
  without rebuilding them.
- **Prefetch** (§5.2): while the active model serves, the next model is copied
  into free arena space on the worker's prefetch thread. Activating it then
  costs only binding its views where it already is. Placement: right after
  the active model (bump allocation) if it fits, else in the free space
  below the active model (left by the model before it); only when neither
  fits is the active model *promoted* to the bottom of the arena (an
  overlap-safe on-device copy) to make room. The paper promotes every
  prefetched model; on a CPU that copy costs as much as the load it saves,
  so promotion here is the last resort. Activating a model other than the
  one being prefetched cancels that copy within one chunk.
- **Bytes still in place**: the switcher remembers which arena ranges still
  hold a model's bytes as they were last copied there (a copy or a promotion
  over a range forgets what it overlaps). A scale-up or a prefetch into the
  range a model's bytes still occupy binds them without a copy (its record
  says ``resident``): two models that fit the arena together (static
  multiplexing, or two models alternating on a decode instance) stop being
  copied back and forth. With ``keep_resident`` (static multiplexing) a
  scale-up that was not prefetched is placed as a prefetch would be, beside
  the active model rather than over it, so both stay.
- **Mapped weights** (``map_weights``, CPU only): the engine's views are bound
  over the Model Cache's shared memory itself, so a scale-up copies nothing:
  it binds views over the kept mapping (a round trip to the cachemgr only on
  first use or after an eviction; prefetch does that one off the critical
  path). On a CPU the buffer a GPU copies into is the same DRAM the cache
  lives in: the copy bought nothing, and on a busy host its memory traffic and
  the prefetch thread's core time came out of decode (~7% of a decode
  worker's samples at 20 models). Safe without a pin for the same reason the
  copy is: a resident region is never written again and its pages live as
  long as a tensor over them does, so an eviction while a model is active
  only delays the release of its pages until the worker moves on (at most the
  active and the prefetched model per worker, no more than the arena a copy
  would hold). The last views bound per model are kept; those over an
  evicted region are dropped at the next prefetch.

- **Tensor parallelism** (``shards`` of a group's rank, ``aegaeon_runtime.tp``):
  a sharded model is this rank's shard (its spec, its byte range of the Model
  Cache region, bound with the group's all-reduce); rank 0's switcher tells
  the followers (``mirror``) of every switch, prefetch and eviction of a
  sharded model *before* its own copy, so every rank copies its shard at
  once. A model the group does not split is rank 0's alone.
- **CUDA graphs** (the engine's, on a GPU): a graph replays the bytes at the
  address it was captured over. So a scale-up or a prefetch copies a model to
  an arena offset where graphs of its layout already are, when one is free
  (``Engine.graph_addresses``), and binds it with the copy's event: the first
  replay waits on it. Elsewhere it lands as above, and the engine captures
  graphs for the new place at its first step (or runs eager; graphs.py).

All methods except the background copy run on the compute thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from aegaeon_common.config import SchedulerConfig
from aegaeon_common.messages.report import SwitchRecord
from aegaeon_engine import Engine, ModelSpec, ModelWeights, bind_weights
from aegaeon_engine.model import ReduceFn
from aegaeon_gpumem import Allocation, DeviceBuffer, copy_chunked
from aegaeon_sched import CHARGED_POLICIES

from aegaeon_runtime.cacheclient.client import SyncCacheClient, model_region
from aegaeon_runtime.cacheclient.mapped import MappedModel
from aegaeon_runtime.prefetcher import PREFETCH_CHUNK_BYTES, Prefetcher, PrefetchJob
from aegaeon_runtime.tp_shards import Shards


class SwitchMirror(Protocol):
    """Rank 0's voice to its followers (``aegaeon_runtime.tp.group``)."""

    def activate(self, name: str) -> None: ...
    def prefetch(self, name: str) -> None: ...
    def evict(self, name: str) -> None: ...


def prefetches(scheduler: SchedulerConfig) -> bool:
    """Whether a worker's switcher prefetches: as configured, except under a charged
    baseline (ServerlessLLM: the next model is unknown until the instance is idle, and
    every scale-up pays its load path)."""
    return scheduler.prefetch and scheduler.policy not in CHARGED_POLICIES


def keeps_resident(scheduler: SchedulerConfig) -> bool:
    """Whether an instance's models stay resident in its arena (static-mux: MuxServe)."""
    return scheduler.policy == "static-mux"


@dataclass
class Resident:
    """A model's weights in the arena, with views bound over them."""

    name: str
    allocation: Allocation | None  # None: mapped in place from the Model Cache
    weights: ModelWeights
    ready: object | None = None  # the event of the copy that put the bytes there (CUDA)


class ModelSwitcher:
    """Keeps one model active in ``engine`` and at most one prefetched."""

    def __init__(
        self,
        engine: Engine,
        buffer: DeviceBuffer,
        cache: SyncCacheClient,
        specs: Mapping[str, ModelSpec],
        dtype: str,
        *,
        prefetch: bool = True,
        copy_threads: int | None = None,
        map_weights: bool = False,
        keep_resident: bool = False,
        shards: Shards | None = None,
        reduce: ReduceFn | None = None,
        mirror: SwitchMirror | None = None,
    ) -> None:
        self.engine = engine
        self.buffer = buffer
        self.cache = cache
        self.specs = dict(specs)
        self.dtype = dtype
        # tensor parallelism: this rank's part of each model, the group's all-reduce
        # (bound with a sharded model) and, on rank 0, the followers' ear
        self.shards = shards or Shards(dtype=dtype, block_size=engine.block_size)
        for name, spec in self.specs.items():
            self.shards.add(name, spec)
        self.reduce = reduce
        self.mirror = mirror
        self.prefetch_enabled = prefetch
        self.copy_threads = copy_threads
        self.map_weights = map_weights
        # static multiplexing: a scale-up that was not prefetched goes where the prefetch
        # would have put it (beside the active model), not over it, so that the models of
        # an instance whose arena holds them stay there
        self.keep_resident = keep_resident
        # map_weights: model -> (its mapping, views over it), the last bound; entries
        # whose region the cachemgr evicted are dropped by the prefetch thread
        self._mapped_views: dict[str, tuple[MappedModel, ModelWeights]] = {}
        self.active: Resident | None = None
        self._prefetch: PrefetchJob | None = None
        self._prefetcher = Prefetcher(self._run_prefetch)
        # (model, arena offset) -> views over those bytes, at most _max_views;
        # used by the compute and the prefetch thread.
        self._views: dict[tuple[str, int], ModelWeights] = {}
        self._views_lock = threading.Lock()
        self._max_views = 2 * max(len(self.specs), 1)
        # arena ranges that still hold a model's bytes as last copied there:
        # offset -> (model, nbytes); guarded by _views_lock (the prefetch thread copies)
        self._in_place: dict[int, tuple[str, int]] = {}
        self.num_promotions = 0
        self.num_placed_below = 0
        # changes to the models on the device (switch, prefetch, eviction): a reader on
        # another thread tells a newer picture of resident_models() from an older one
        self.residency_version = 0

    # ---- queries ---------------------------------------------------------
    @property
    def active_model(self) -> str | None:
        return self.active.name if self.active else None

    def resident_models(self) -> list[str]:
        """The models on the device: the active one, the one being prefetched."""
        pending = self._prefetch  # (read once: another thread may be asking)
        names = [self.active.name] if self.active is not None else []
        if pending is not None and pending.name not in names:
            names.append(pending.name)
        return names

    def add_model(self, name: str, spec: ModelSpec) -> None:
        """Serve one more model (its weights come at its first switch)."""
        self.specs[name] = spec
        self.shards.add(name, spec)

    def spec(self, name: str) -> ModelSpec:
        """What this rank binds of ``name`` (its shard's spec, or the whole model's)."""
        return self.shards.spec(name)

    def nbytes(self, name: str) -> int:
        """This rank's bytes of ``name`` (its shard's, for a sharded model)."""
        return self.engine.layout(self.spec(name), self.dtype).total_bytes

    def _whole_bytes(self, name: str) -> int:
        return self.engine.layout(self.specs[name], self.dtype).total_bytes

    def _source(self, mapped: MappedModel, name: str) -> torch.Tensor:
        """This rank's bytes of ``name``'s Model Cache region (checked against the region)."""
        whole = self._whole_bytes(name)
        expected = self.shards.region_bytes(name, whole)
        if mapped.nbytes != expected:
            raise RuntimeError(
                f"Model Cache region of {mapped.name!r} holds {mapped.nbytes} bytes, the "
                f"engine's layout {expected}: cachemgr and worker disagree on the dtype "
                f"or the tensor-parallel size"
            )
        start, stop = self.shards.region_range(name, whole)
        return mapped.data[start:stop]

    def _graph_offsets(self, name: str) -> list[int]:
        """Arena offsets where the engine holds CUDA graphs of ``name``'s layout and the
        model fits (most recently used first)."""
        addresses = self.engine.graph_addresses(self.spec(name), self.dtype)
        if not addresses:
            return []
        base, nbytes = self.buffer.tensor.data_ptr(), self.nbytes(name)
        limit = self.buffer.weights_capacity
        return [a - base for a in addresses if a - base >= 0 and a - base + nbytes <= limit]

    def _alloc_in_empty_arena(self, name: str) -> Allocation:
        """After a reset: at an offset holding graphs of its layout if any, else at 0."""
        offsets = self._graph_offsets(name)
        if offsets:
            return self.buffer.arena.alloc_at(offsets[0], self.nbytes(name))
        return self.buffer.alloc(self.nbytes(name))

    def _ready_event(self) -> object | None:
        """An event after the copy just made (CUDA): replays wait on it."""
        device = self.buffer.device
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return event

    def _bind(self, name: str, allocation: Allocation) -> Resident:
        key = (name, allocation.offset)
        with self._views_lock:
            weights = self._views.get(key)
        if weights is None:
            spec = self.spec(name)
            view = self.buffer.view(allocation.offset, allocation.nbytes)
            weights = bind_weights(spec, self.engine.layout(spec, self.dtype), view)
            with self._views_lock:
                if len(self._views) >= self._max_views:
                    del self._views[next(iter(self._views))]  # the oldest
                self._views[key] = weights
        return Resident(name, allocation, weights, self._ready_event())

    def _copy_in(
        self, name: str, allocation: Allocation, job: PrefetchJob | None = None
    ) -> tuple[float, bool]:
        """Copy ``name`` from the Model Cache into ``allocation``, unless its bytes are
        still there; seconds spent, and whether they were."""
        key = (name, allocation.nbytes)
        with self._views_lock:
            if self._in_place.get(allocation.offset) == key:
                return 0.0, True
            self._forget_range(allocation.offset, allocation.nbytes)
        source = self._source(model_region(self.cache, name), name)
        seconds = self._copy_from(source, allocation, job)
        with self._views_lock:
            self._in_place[allocation.offset] = key
        return seconds, False

    def _forget_range(self, offset: int, nbytes: int) -> None:
        """What the arena held in ``[offset, offset + nbytes)`` is being overwritten
        (caller holds ``_views_lock``)."""
        end = offset + nbytes
        for start, (_, size) in list(self._in_place.items()):
            if start < end and offset < start + size:
                del self._in_place[start]

    def forget_bytes(self, name: str) -> None:
        """``name``'s bytes changed (a model added again under its name): never bind
        what the arena still holds of it."""
        with self._views_lock:
            for start, (held, _) in list(self._in_place.items()):
                if held == name:
                    del self._in_place[start]
            for key in [k for k in self._views if k[0] == name]:
                del self._views[key]

    def _copy_from(
        self, src: torch.Tensor, allocation: Allocation, job: PrefetchJob | None = None
    ) -> float:
        if src.numel() != allocation.nbytes:
            raise RuntimeError(f"{src.numel()} bytes to copy into an allocation of "
                               f"{allocation.nbytes}")  # fmt: skip
        start = time.perf_counter()
        dst = self.buffer.view(allocation.offset, allocation.nbytes)
        if job is None:  # on the critical path: one copy at full speed
            copy_chunked(dst, src, num_threads=self.copy_threads)
        else:  # in the background: chunks, so that a cancel stops it quickly
            for first in range(0, allocation.nbytes, PREFETCH_CHUNK_BYTES):
                job.check()
                last = min(first + PREFETCH_CHUNK_BYTES, allocation.nbytes)
                copy_chunked(dst[first:last], src[first:last], num_threads=1)
        return time.perf_counter() - start

    def _map(self, name: str, job: PrefetchJob | None = None) -> float:
        """``map_weights``: bind views over ``name``'s Model Cache region; seconds spent.

        The result goes to ``job`` (a prefetch) or becomes the active model.
        """
        start = time.perf_counter()
        mapped = model_region(self.cache, name)
        spec = self.spec(name)
        layout = self.engine.layout(spec, self.dtype)
        source = self._source(mapped, name)
        with self._views_lock:
            kept = self._mapped_views.get(name)
        if kept is not None and kept[0].region.name == mapped.region.name:
            weights = kept[1]
        else:
            weights = bind_weights(spec, layout, source)
            with self._views_lock:
                self._mapped_views[name] = (mapped, weights)
        resident = Resident(name, None, weights)
        if job is not None:
            job.result = resident
        else:
            self._activate(resident)
        return time.perf_counter() - start

    def _drop_evicted_views(self) -> None:
        """Forget the views over regions the cachemgr evicted, so that their pages go
        once no active or prefetched model uses them (a stat per kept model)."""
        with self._views_lock:
            kept = list(self._mapped_views.items())
        gone = [(name, entry) for name, entry in kept if not entry[0].region.linked()]
        with self._views_lock:
            for name, entry in gone:
                if self._mapped_views.get(name) is entry:  # not re-bound meanwhile
                    del self._mapped_views[name]

    def _activate(self, resident: Resident) -> None:
        self.active = resident
        name = resident.name
        reduce = self.reduce if self.shards.sharded(name) else None
        self.engine.bind(self.spec(name), resident.weights, self.buffer.kv_region, reduce=reduce,
                         ready=resident.ready)

    # ---- switching -------------------------------------------------------
    def activate(self, name: str, now_s: float | None = None) -> SwitchRecord | None:
        """Make ``name`` the engine's model; ``None`` if it already is."""
        if name not in self.specs:
            raise KeyError(f"unknown model {name!r}")
        if self.active is not None and self.active.name == name:
            return None
        if self.mirror is not None and self.shards.sharded(name):
            self.mirror.activate(name)  # every follower copies its shard meanwhile
        start = time.perf_counter()
        previous = self.active_model
        pending = self._prefetch
        self._prefetch = None
        if pending is not None:
            if pending.name != name:
                pending.cancelled.set()  # its bytes are not needed: stop within a chunk
            pending.done.wait()  # never reuse memory a copy is still writing
        resident = False
        if pending is not None and pending.name == name and isinstance(pending.result, Resident):
            self._activate(pending.result)
            load_s, prefetched, resident = pending.copy_s, True, pending.in_place
        elif self.map_weights:
            load_s, prefetched = self._map(name), False
        else:
            nbytes = self.nbytes(name)
            beside = self._place(name) if self.keep_resident else None
            self.active = None
            if beside is not None:
                allocation = beside
            else:
                self.buffer.reset()  # scale-down: the old model's bytes are simply reused
                allocation = self._kept(name, nbytes) or self._alloc_in_empty_arena(name)
            self.buffer.arena.set_top(allocation)
            load_s, resident = self._copy_in(name, allocation)
            self._activate(self._bind(name, allocation))
            prefetched = False
        self.residency_version += 1
        return SwitchRecord(
            from_model=previous,
            to_model=name,
            total_s=time.perf_counter() - start,
            load_s=load_s,
            prefetched=prefetched,
            at_s=time.time() if now_s is None else now_s,
            resident=resident,
        )

    def prefetch(self, name: str) -> bool:
        """Start copying ``name`` into free arena space; ``False`` if it cannot now."""
        if not self.prefetch_enabled or name not in self.specs:
            return False
        if self.active is not None and self.active.name == name:
            return False
        if self._prefetch is not None:
            return self._prefetch.name == name  # one at a time
        if self.mirror is not None and self.shards.sharded(name):
            self.mirror.prefetch(name)
        if self.map_weights:
            allocation = None
        else:
            allocation = self._place(name)
            if allocation is None:
                return False
        job = PrefetchJob(name, allocation)
        self._prefetch = job
        self._prefetcher.submit(job)
        self.residency_version += 1
        return True

    def evict(self, name: str) -> bool:
        """Take ``name`` off the device (a sleeping model): its prefetch is cancelled,
        or, active, it is scaled down (the engine's views stay bound over bytes that
        are free now: the caller runs nothing of it before its next :meth:`activate`).
        Its bytes stay in the Model Cache. True if it was on the device."""
        if self.mirror is not None and self.shards.sharded(name):
            self.mirror.evict(name)
        evicted = False
        pending = self._prefetch
        if pending is not None and pending.name == name:
            pending.cancelled.set()
            pending.done.wait()  # never reuse memory a copy is still writing
            self._prefetch = None
            evicted = True
        if self.active is not None and self.active.name == name:
            self.active = None
            if self._prefetch is None:  # a prefetch in flight keeps its allocation
                self.buffer.reset()
            evicted = True
        if evicted:
            self.residency_version += 1
        return evicted

    def _kept(self, name: str, nbytes: int) -> Allocation | None:
        """Where ``name``'s bytes still are in the arena, clear of the active model."""
        active = self.active.allocation if self.active is not None else None
        with self._views_lock:
            for offset, held in self._in_place.items():
                if held != (name, nbytes):
                    continue
                if active is not None and offset < active.end and active.offset < offset + nbytes:
                    continue
                return Allocation(offset, nbytes)
        return None

    def _place(self, name: str) -> Allocation | None:
        """Free arena space for prefetching ``name`` (see the module docstring), or None;
        where the model's bytes still are when they are."""
        nbytes = self.nbytes(name)
        kept = self._kept(name, nbytes)
        if kept is not None:
            return kept  # (the arena learns of it when it is the active model)
        if self.active is None:
            if not self.buffer.fits(nbytes):
                return None
            empty = self.buffer.arena.top == 0
            return self._alloc_in_empty_arena(name) if empty else self.buffer.alloc(nbytes)
        active = self.active.allocation
        assert active is not None  # a mapped model is never in the arena
        # Only the active model stays: drop stale allocations above it.
        self.buffer.arena.set_top(active)
        for offset in self._graph_offsets(name):  # where its graphs are, if that is free
            if offset + nbytes <= active.offset:
                return Allocation(offset, nbytes)
            if offset >= self.buffer.arena.top:
                return self.buffer.arena.alloc_at(offset, nbytes)
        if self.buffer.fits(nbytes):
            return self.buffer.alloc(nbytes)
        if active.offset >= nbytes:
            self.num_placed_below += 1
            return Allocation(0, nbytes)  # the gap the previous model left below
        if active.offset > 0:
            self._promote_active()
            if self.buffer.fits(nbytes):
                return self.buffer.alloc(nbytes)
        return None

    def _run_prefetch(self, job: PrefetchJob) -> None:
        if job.allocation is None:  # map_weights
            job.copy_s = self._map(job.name, job)
            self._drop_evicted_views()
            return
        job.copy_s, job.in_place = self._copy_in(job.name, job.allocation, job)
        job.result = self._bind(job.name, job.allocation)

    def _promote_active(self) -> None:
        """Move the active model down to offset 0 (on-device copy), rebind its views."""
        assert self.active is not None and self.active.allocation is not None
        old = self.active.allocation
        with self._views_lock:  # both ranges: an overlapping move changes the old one too
            self._forget_range(old.offset, old.nbytes)
            self._forget_range(0, old.nbytes)
        moved = self.buffer.promote(old.offset, old.nbytes, 0)
        with self._views_lock:
            self._in_place[moved.offset] = (self.active.name, moved.nbytes)
        self._activate(self._bind(self.active.name, moved))
        self.num_promotions += 1

    def prefetched_model(self) -> str | None:
        return self._prefetch.name if self._prefetch else None

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel a prefetch and stop its thread, waiting at most ``timeout_s`` for each
        (a load stuck on a cachemgr that is gone must not keep the process alive)."""
        if self._prefetch is not None:
            self._prefetch.cancelled.set()
            self._prefetch.done.wait(timeout_s)
            self._prefetch = None
        self._prefetcher.close(timeout_s)

