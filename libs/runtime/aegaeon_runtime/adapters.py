"""A worker's LoRA adapters: which it serves, and which are on its device.

An adapter serves on its base's weights: the switcher switches the base (the
switching unit), and a step of the base's batch may mix rows of the base and
of any number of its adapters (aegaeon_engine.lora). Here each adapter's own
matrices are brought to the device when a step needs them and the base is
active (megabytes, not a weight switch):

- **mapped** (``weights: map``, CPU): its views are bound over the Model Cache's
  region of it, as a mapped model's are: nothing is copied.
- **copied** (a GPU): its bytes go into the device buffer's adapter region
  (``adapter_memory``), bump-allocated; when a step's adapters do not fit
  beside those already there, the region is refilled with the step's alone
  (least recently used ones leave first). Those of a step that still do not fit
  wait for a later step (:meth:`AdapterResidency.for_step` leaves them out).

Views stay valid while their bytes do: a copied adapter's views are dropped
when the region is refilled, and the engine's stacked copies of them
(``Engine.lora_stacks``) are told to forget them. Runs on the compute thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from aegaeon_engine import ModelSpec
from aegaeon_engine.lora import AdapterWeights, LoraStacks, bind_adapter
from aegaeon_engine.lora_spec import AdapterSpec, adapter_layout
from aegaeon_gpumem import BumpArena, copy_chunked

from aegaeon_runtime.cacheclient.client import SyncCacheClient, model_region
from aegaeon_runtime.cacheclient.mapped import MappedModel


@dataclass
class _Placed:
    weights: AdapterWeights
    mapped: MappedModel | None  # the Model Cache mapping it is bound over (mapped mode)


class AdapterResidency:
    """The adapters served here (``specs``) and those on the device (see the module)."""

    def __init__(self, cache: SyncCacheClient, dtype: str, region: torch.Tensor | None,
                 stacks: LoraStacks) -> None:
        """``region``: the device buffer's adapter region (copy mode), None to bind over
        the Model Cache's mappings (mapped mode)."""
        self.cache = cache
        self.dtype = dtype
        self.region = region
        self._arena = BumpArena(region.numel()) if region is not None else None
        self._stacks = stacks
        self.specs: dict[str, AdapterSpec] = {}
        self._placed: OrderedDict[str, _Placed] = OrderedDict()  # least recently used first
        self.num_loads = 0  # adapters brought to the device (copies or bindings)
        self.load_s = 0.0
        self.version = 0  # changes to resident()

    # ---- what is served --------------------------------------------------------
    def add(self, name: str, path: Path, base: ModelSpec) -> AdapterSpec:
        """Serve adapter ``name`` (its PEFT directory at ``path``) of ``base`` from now on
        (``CheckpointError`` if it cannot be)."""
        spec = AdapterSpec.from_dir(path, base, name)
        if name in self.specs:
            self.evict(name)
        self.specs[name] = spec
        return spec

    def base_of(self, name: str) -> str | None:
        """The base model of ``name`` when it is an adapter served here."""
        spec = self.specs.get(name)
        return spec.base.name if spec is not None else None

    def nbytes(self, name: str) -> int:
        return adapter_layout(self.specs[name], self.dtype).total_bytes

    # ---- on the device -----------------------------------------------------------
    def resident(self) -> list[str]:
        return list(self._placed)

    def with_adapters(self, models: Sequence[str]) -> list[str]:
        """``models`` (those on the device) and the adapters of them on the device too."""
        on = list(models)
        return on + [a for a in self._placed if self.base_of(a) in on and a not in on]

    def for_step(self, names: Sequence[str | None]) -> list[AdapterWeights | None]:
        """Each row's adapter weights on the device: None for a row of the base (a None
        name), and for a row whose adapter found no room this step (copy mode: the
        caller leaves those rows for a later step). Raises ``ModelGoneError`` for an
        adapter the node's cachemgr no longer holds (``ModelUnavailableError``: cannot
        read)."""
        wanted = list(dict.fromkeys(n for n in names if n is not None))
        placed = self._ensure(wanted)
        return [None if n is None else placed.get(n) for n in names]

    def evict(self, name: str) -> bool:
        """Take ``name`` off the device (its views dropped); True if it was there."""
        placed = self._placed.pop(name, None)
        if placed is None:
            return False
        self._stacks.forget(placed.weights)
        self.version += 1
        if self._arena is not None and not self._placed:
            self._arena.reset()
        return True

    def forget(self, name: str) -> None:
        """No longer served here."""
        self.evict(name)
        self.specs.pop(name, None)

    def _ensure(self, names: list[str]) -> dict[str, AdapterWeights]:
        out: dict[str, AdapterWeights] = {}
        for name in names:
            placed = self._placed.get(name)
            if placed is not None and (placed.mapped is None or placed.mapped.region.linked()):
                self._placed.move_to_end(name)
                if placed.mapped is not None:
                    self.cache.note_use(name)
                out[name] = placed.weights
        missing = [n for n in names if n not in out]
        if not missing:
            return out
        start = time.perf_counter()
        if self._arena is None:
            for name in missing:
                self._map(name)
        else:
            self._copy(missing, keep=[n for n in names if n in out])
        self.load_s += time.perf_counter() - start
        self.version += 1
        return {n: p.weights for n in names if (p := self._placed.get(n)) is not None}

    def _check_size(self, name: str, mapped: MappedModel, nbytes: int) -> None:
        if mapped.nbytes != nbytes:
            raise RuntimeError(f"Model Cache region of adapter {name!r} holds {mapped.nbytes} "
                               f"bytes, the engine's layout {nbytes}: cachemgr and worker "
                               "disagree on the dtype")

    def _map(self, name: str) -> AdapterWeights:
        spec = self.specs[name]
        layout = adapter_layout(spec, self.dtype)
        mapped = model_region(self.cache, name)
        self._check_size(name, mapped, layout.total_bytes)
        old = self._placed.pop(name, None)
        if old is not None:
            self._stacks.forget(old.weights)
        weights = bind_adapter(spec, layout, mapped.data)
        self._placed[name] = _Placed(weights, mapped)
        self.num_loads += 1
        return weights

    def _copy(self, missing: list[str], keep: list[str]) -> None:
        """Copy ``missing`` into the region beside ``keep`` (there already); refill the
        region with the step's adapters alone when they do not fit beside the others
        (those that fit, in the step's order: the rest wait)."""
        arena, region = self._arena, self.region
        assert arena is not None and region is not None
        sizes = {n: self.nbytes(n) for n in (*keep, *missing)}
        if sum(sizes[n] for n in missing) > arena.capacity_bytes - arena.top:
            for name in list(self._placed):  # refill: the step's adapters alone
                self.evict(name)
            arena.reset()
            missing = keep + missing
        for name in missing:
            if not arena.fits(sizes[name]):
                continue  # no room this step: its rows wait
            allocation = arena.alloc(sizes[name])
            mapped = model_region(self.cache, name)
            self._check_size(name, mapped, sizes[name])
            dest = region[allocation.offset:allocation.offset + sizes[name]]
            copy_chunked(dest, mapped.data)
            spec = self.specs[name]
            self._placed[name] = _Placed(bind_adapter(spec, adapter_layout(spec, self.dtype),
                                                      dest), None)
            self.num_loads += 1
