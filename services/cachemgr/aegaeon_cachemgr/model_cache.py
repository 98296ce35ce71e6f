"""The Model Cache: each model's packed weights in one shared-memory region, LRU under a budget.

Invariants:
- ``used_bytes`` (resident + being loaded) never exceeds ``budget_bytes``; a
  load reserves its bytes before its region exists.
- A pinned model (some worker is reading it, or the operator pinned it:
  owner :data:`OPERATOR`, at most one such pin) is never evicted.
- Models come and go at run time (:meth:`ModelCache.register`,
  :meth:`ModelCache.forget`): a forgotten model takes no new load and
  leaves the cache as soon as no worker pins it.
- A region is resident only once completely filled; a failed load unlinks its
  region and changes nothing else. Concurrent requests for one model share
  one load.
- Loading runs on a thread, so the event loop keeps serving other requests.
- A model whose checkpoint cannot be read (a missing or truncated file, a bad
  header, wrong shapes, a file whose size or content differs from what
  ``market.json`` records) is *unavailable*: every load of it is refused with
  ``checkpoint_error`` and that first error, without reading the disk again,
  until :meth:`ModelCache.reload`. Found at start (:meth:`ModelCache.check`: sizes
  and headers, cheap), by a load, or by a reload. The digests are checked on a
  model's first load (and again once its files changed), while its bytes are read.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from aegaeon_common.logs import get_logger
from aegaeon_common.market_files import digest_problem, size_problem, stat_signature
from aegaeon_common.market_index import FileRecord
from aegaeon_common.messages.cache import ModelCacheStats, ResidentModel
from aegaeon_gpumem.shm import SHM_DIR, ShmRegion

from aegaeon_cachemgr.errors import CacheError
from aegaeon_cachemgr.model_loader import ModelPlan, check_plan, fill_region, plan_model

log = get_logger("cachemgr.models")


@dataclass
class ModelEntry:
    """A resident model: its plan, its filled region and who pins it."""

    plan: ModelPlan
    region: ShmRegion
    load_s: float = 0.0
    pins: Counter[str] = field(default_factory=Counter)


OPERATOR = "operator"  # the owner of pins the operator asked for (SetModelFlags)


@dataclass
class _Loading:
    plan: ModelPlan
    region: ShmRegion
    done: asyncio.Future[ModelEntry]
    pins: Counter[str] = field(default_factory=Counter)
    filled_bytes: int = 0  # written by the loader thread: progress
    verify: tuple[FileRecord, ...] = ()  # files whose digests this load checks
    signature: tuple[tuple[str, int, int], ...] = ()  # their stat when the load began


Records = Callable[[Path], tuple[FileRecord, ...]]


def _no_records(path: Path) -> tuple[FileRecord, ...]:
    return ()


def reserve_pages(name: str, nbytes: int) -> None:
    """Commit a segment's pages now: ENOSPC here instead of SIGBUS on a later write."""
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


class ModelCache:
    """Models by name -> resident regions; see the module docstring for the invariants."""

    def __init__(
        self,
        models: Mapping[str, Path],
        dtype: str,
        budget_bytes: int,
        name_prefix: str,
        executor: Executor,
        bases: Mapping[str, str] | None = None,
        records: Records = _no_records,
        tp: int = 1,
    ) -> None:
        """``bases``: the LoRA adapters among ``models``, each with its base's name;
        ``records(model_dir)``: what the market records of a model's files (sizes,
        digests; () when nothing)."""
        self._paths = dict(models)
        self._bases = dict(bases or {})
        self._records = records
        # name -> why its checkpoint cannot be read (refused until reload)
        self.unavailable: dict[str, str] = {}
        self.num_quarantines = 0
        # name -> the stat of its recorded files when their digests last matched
        self._verified: dict[str, tuple[tuple[str, int, int], ...]] = {}
        self._dtype = dtype
        self._tp = tp  # the instances' tensor-parallel size: regions hold shards
        self.budget_bytes = budget_bytes
        self._prefix = name_prefix
        self._executor = executor
        self._resident: OrderedDict[str, ModelEntry] = OrderedDict()  # LRU first
        self._loading: dict[str, _Loading] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._forgotten: set[str] = set()  # removed while pinned or loading: evict when free
        self._seq = itertools.count()
        self.num_loads = 0
        self.num_hits = 0
        self.num_misses = 0  # acquisitions that waited for a load (started or shared)
        self.num_evictions = 0
        self.load_s_total = 0.0
        self.loaded_bytes_total = 0

    @property
    def used_bytes(self) -> int:
        resident = sum(e.plan.nbytes for e in self._resident.values())
        return resident + sum(ld.plan.nbytes for ld in self._loading.values())

    async def acquire(
        self, name: str, owner: str, pin: bool, evict: bool = True
    ) -> tuple[ModelEntry, bool]:
        """The resident entry of ``name`` (loading it first if needed) and whether it was a hit.

        With ``pin`` the model is pinned for ``owner`` before this returns (pins
        of a shared load are applied when it completes, so no eviction can
        slip in between). ``evict=False`` refuses rather than evicts (prewarm).
        """
        self._check_known(name)
        self._check_available(name)
        entry = self._resident.get(name)
        if entry is not None:
            self._resident.move_to_end(name)
            if pin:
                entry.pins[owner] += 1
            self.num_hits += 1
            return entry, True
        loading = self._loading.get(name) or self._start(name, evict)
        self.num_misses += 1
        if pin:
            loading.pins[owner] += 1
        # shield: a cancelled waiter must not cancel the load others share.
        return await asyncio.shield(loading.done), False

    def _check_known(self, name: str) -> None:
        if name not in self._paths:
            known = ", ".join(sorted(self._paths))
            raise CacheError(
                "unknown_model", f"unknown model {name!r} (known: {known})", {"model": name}
            )

    def _check_available(self, name: str) -> None:
        why = self.unavailable.get(name)
        if why is not None:
            raise CacheError("checkpoint_error", why, {"model": name})

    # ---- checkpoints that cannot be read (quarantine) ----------------------
    def check(self, name: str) -> CacheError | None:
        """What is wrong with ``name``'s checkpoint that a stat per file and its headers
        tell (sizes against the market's records, config, tensor names, shapes and
        dtypes, each tensor inside its file), or None. Blocking: run it on a thread."""
        path = self._paths.get(name)
        if path is None:
            return None
        problem = size_problem(path, self._records(path))
        if problem is not None:
            return CacheError("checkpoint_error", problem, {"model": name})
        try:
            check_plan(self._plan(name))
        except CacheError as exc:
            return exc
        except (OSError, ValueError, KeyError) as exc:  # a config the layout cannot take
            return CacheError("checkpoint_error", f"{path}: {type(exc).__name__}: {exc}",
                              {"model": name})  # fmt: skip
        return None

    def check_all(self) -> dict[str, CacheError]:
        """:meth:`check` of every model (at start, on a thread); the failures by name."""
        problems = {name: self.check(name) for name in list(self._paths)}
        return {name: exc for name, exc in problems.items() if exc is not None}

    def quarantine(self, name: str, why: str) -> None:
        """``name`` cannot be read: every load of it is refused until :meth:`reload`."""
        if name not in self._paths or name in self.unavailable:
            return
        self.unavailable[name] = why
        self.num_quarantines += 1
        log.error("model_unavailable", model=name, error=why)

    def reload(self, name: str, path: Path) -> None:
        """Serve ``name`` from ``path`` again as if new: its quarantine lifted, its digests
        checked again at its next load, an unpinned resident copy evicted (the next
        load reads the disk)."""
        self.register(name, path, self._bases.get(name))
        if self.unavailable.pop(name, None) is not None:
            log.info("model_reloaded", model=name, path=str(path))
        self._verified.pop(name, None)
        entry = self._resident.get(name)
        if entry is not None and not entry.pins:
            self.evict(name)

    # ---- models at run time (model lifecycle) ----------------------------
    def register(self, name: str, path: Path, base: str | None = None) -> None:
        """Serve ``name`` (its checkpoint at ``path``; with ``base``, a LoRA adapter of
        that model) from now on; idempotent."""
        self._paths[name] = path
        if base:
            self._bases[name] = base
        else:
            self._bases.pop(name, None)
        self._forgotten.discard(name)

    def forget(self, name: str) -> bool:
        """Stop serving ``name``: no new loads, its operator pin dropped; True when it is
        out of the cache now (else it leaves once no worker pins it)."""
        self._paths.pop(name, None)
        self._bases.pop(name, None)
        self.unavailable.pop(name, None)
        self._verified.pop(name, None)
        self.set_pinned(name, False)
        entry = self._resident.get(name)
        if entry is not None and not entry.pins:
            self.evict(name)
        elif entry is not None or name in self._loading:
            self._forgotten.add(name)
            return False
        return True

    def set_pinned(self, name: str, pinned: bool) -> None:
        """The operator's pin on ``name`` (resident or loading): on (one pin) or off."""
        pins = self._pins_of(name)
        if pins is None:
            return
        if pinned:
            pins[OPERATOR] = 1
        else:
            pins.pop(OPERATOR, None)

    def ensure_loading(self, name: str, pin: bool) -> None:
        """Start loading ``name`` in the background unless it is resident (evicting
        unpinned models for room; a ``CacheError`` at once if it cannot fit), and set
        the operator's pin on it when ``pin``. Does not wait for the load."""
        self._check_known(name)
        self._check_available(name)
        if name not in self._resident and name not in self._loading:
            self._start(name, True)
        if pin:
            self.set_pinned(name, True)

    def progress(self, name: str) -> float:
        """Share of ``name``'s bytes in the cache: 1 resident, 0 absent, else loading."""
        if name in self._resident:
            return 1.0
        loading = self._loading.get(name)
        if loading is None:
            return 0.0
        return min(1.0, loading.filled_bytes / max(loading.plan.nbytes, 1))

    def operator_pinned(self) -> list[str]:
        return sorted(n for n, pins in self._all_pins() if pins.get(OPERATOR))

    def _pins_of(self, name: str) -> Counter[str] | None:
        entry = self._resident.get(name)
        if entry is not None:
            return entry.pins
        loading = self._loading.get(name)
        return loading.pins if loading is not None else None

    def _evict_if_forgotten(self, name: str) -> None:
        entry = self._resident.get(name)
        if name in self._forgotten and entry is not None and not entry.pins:
            self._forgotten.discard(name)
            self.evict(name)

    def _plan(self, name: str) -> ModelPlan:
        """``name``'s region (a LoRA adapter's checked against its base's checkpoint)."""
        base = self._bases.get(name)
        base_path = self._paths.get(base) if base is not None else None
        if base is not None and base_path is None:
            raise CacheError("unknown_model", f"adapter {name!r}: its base {base!r} is not "
                             "served", {"model": name})  # fmt: skip
        return plan_model(name, self._paths[name], self._dtype, self._tp, base_path)

    def _start(self, name: str, evict: bool) -> _Loading:
        path = self._paths[name]
        try:
            plan = self._plan(name)
        except CacheError as exc:
            if exc.code == "checkpoint_error":
                self.quarantine(name, exc.message)
            raise
        # the digests on its first load, and again once its files changed since
        files = self._records(path)
        signature = stat_signature(path, files)
        verify = files if files and self._verified.get(name) != signature else ()
        self._make_room(plan, evict)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64]
        try:
            region = ShmRegion.create(
                f"{self._prefix}model-{next(self._seq)}-{safe}", max(plan.nbytes, 1)
            )
        except OSError as exc:
            raise _no_space(plan, exc) from None
        loop = asyncio.get_running_loop()
        loading = _Loading(plan, region, loop.create_future(), verify=verify,
                           signature=signature)  # fmt: skip
        self._loading[name] = loading
        task = loop.create_task(self._fill(loading))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return loading

    async def _fill(self, loading: _Loading) -> None:
        plan, region = loading.plan, loading.region
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        err: CacheError | None = None
        try:
            await loop.run_in_executor(self._executor, self._fill_sync, loading)
        except CacheError as exc:
            err = exc
        except OSError as exc:
            err = _no_space(plan, exc)
        except Exception as exc:
            # A shared load must always resolve: otherwise every later request
            # for this model would wait on it forever.
            log.exception("model_load_crashed", model=plan.name)
            err = CacheError("internal", f"loading {plan.name!r}: {type(exc).__name__}: {exc}")
        if err is not None:
            del self._loading[plan.name]
            region.close()  # unlinks: nothing half-written stays in /dev/shm
            log.warning("model_load_failed", model=plan.name, code=err.code, error=err.message)
            if err.code == "checkpoint_error":
                self.quarantine(plan.name, err.message)
            loading.done.set_exception(err)
            loading.done.exception()  # retrieved: waiters may all be gone
            return
        load_s = time.perf_counter() - started
        del self._loading[plan.name]
        if loading.verify:
            self._verified[plan.name] = loading.signature
        entry = ModelEntry(plan, region, load_s, loading.pins)
        self._resident[plan.name] = entry
        self.num_loads += 1
        self.load_s_total += load_s
        self.loaded_bytes_total += plan.nbytes
        loading.done.set_result(entry)  # first: its waiters go on whatever follows
        log.info(
            "model_loaded",
            model=plan.name,
            region=region.name,
            nbytes=plan.nbytes,
            load_s=round(load_s, 4),
            gb_per_s=round(plan.nbytes / max(load_s, 1e-9) / 1e9, 3),
        )
        self._evict_if_forgotten(plan.name)

    @staticmethod
    def _fill_sync(loading: _Loading) -> None:
        plan, region = loading.plan, loading.region
        reserve_pages(region.name, region.nbytes)

        def progress(nbytes: int) -> None:  # an int store: read by the event loop
            loading.filled_bytes = nbytes

        # the weight files are hashed as they are read; the small rest (config,
        # tokenizer) here
        digests = {plan.path / f.name: f.sha256 for f in loading.verify}
        read = fill_region(plan, region.tensor[: plan.nbytes], progress, digests or None)
        rest = [f for f in loading.verify if plan.path / f.name not in read]
        problem = digest_problem(plan.path, rest)
        if problem is not None:
            raise CacheError("checkpoint_error", problem, {"model": plan.name})

    def _make_room(self, plan: ModelPlan, evict: bool) -> None:
        """Evict least recently used unpinned models until ``plan`` fits; all or nothing."""
        need, used = plan.nbytes, self.used_bytes
        if used + need <= self.budget_bytes:
            return
        victims: list[str] = []
        freed = 0
        for name, entry in self._resident.items() if evict else ():
            if used - freed + need <= self.budget_bytes:
                break
            if not entry.pins:
                victims.append(name)
                freed += entry.plan.nbytes
        if used - freed + need > self.budget_bytes:
            pinned = sum(e.plan.nbytes for e in self._resident.values() if e.pins)
            raise CacheError(
                "model_cache_full",
                f"model {plan.name!r} needs {need} bytes; budget {self.budget_bytes} bytes, "
                f"{used} used ({pinned} pinned){'' if evict else ', eviction not allowed'}",
                {
                    "requested_bytes": need,
                    "budget_bytes": self.budget_bytes,
                    "used_bytes": used,
                    "pinned_bytes": pinned,
                },
            )
        for name in victims:
            self.evict(name)

    def evict(self, name: str) -> None:
        """Drop a resident, unpinned model; workers' existing mappings stay valid."""
        entry = self._resident[name]
        if entry.pins:
            raise CacheError("bad_request", f"model {name!r} is pinned")
        del self._resident[name]
        entry.region.close()
        self.num_evictions += 1
        log.info("model_evicted", model=name, nbytes=entry.plan.nbytes)

    def unpin(self, name: str, owner: str) -> int:
        """Drop one pin of ``owner``; return the model's remaining pins."""
        pins = self._pins_of(name)
        if pins is None or pins[owner] <= 0:
            raise CacheError(
                "not_pinned",
                f"model {name!r} is not pinned by {owner!r}",
                {"model": name, "owner": owner},
            )
        pins[owner] -= 1
        if pins[owner] == 0:
            del pins[owner]
        self._evict_if_forgotten(name)
        return sum(pins.values())

    def release_owner(self, owner: str) -> list[str]:
        """Drop every pin of ``owner`` (its process ended); return the models it pinned."""
        released = []
        for name, pins in self._all_pins():
            if pins.pop(owner, 0):
                released.append(name)
        for name in released:
            self._evict_if_forgotten(name)
        return released

    def pinned_by(self, owner: str) -> list[str]:
        return [name for name, pins in self._all_pins() if pins.get(owner)]

    def _all_pins(self) -> list[tuple[str, Counter[str]]]:
        return [(n, e.pins) for n, e in self._resident.items()] + [
            (n, ld.pins) for n, ld in self._loading.items()
        ]

    def stats(self) -> ModelCacheStats:
        return ModelCacheStats(
            budget_bytes=self.budget_bytes,
            used_bytes=self.used_bytes,
            models=[
                ResidentModel(n, e.region.name, e.plan.nbytes, sum(e.pins.values()), e.load_s)
                for n, e in self._resident.items()
            ],
            loading=sorted(self._loading),
            num_loads=self.num_loads,
            num_hits=self.num_hits,
            num_evictions=self.num_evictions,
            load_s_total=self.load_s_total,
            loaded_bytes_total=self.loaded_bytes_total,
            progress={n: self.progress(n) for n in sorted(self._loading)},
            operator_pinned=self.operator_pinned(),
            known=sorted(self._paths),
            unavailable=dict(sorted(self.unavailable.items())),
        )

    def close(self) -> None:
        """Unlink every region (a load still running on its thread writes into pages
        that are freed when it finishes)."""
        for task in self._tasks:
            task.cancel()
        for loading in self._loading.values():
            loading.region.close()
        for entry in self._resident.values():
            entry.region.close()
        self._loading.clear()
        self._resident.clear()


def _no_space(plan: ModelPlan, exc: OSError) -> CacheError:
    code = "model_cache_full" if exc.errno == errno.ENOSPC else "internal"
    return CacheError(
        code,
        f"cannot place model {plan.name!r} ({plan.nbytes} bytes) in shared memory: "
        f"{exc.strerror or exc}",
        {"requested_bytes": plan.nbytes},
    )
