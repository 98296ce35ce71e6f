"""What a worker holds from the cachemgr: its lease's mappings and mapped model regions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from aegaeon_common.dtypes import FP8, QUANT_BLOCKS, quant_row_bytes
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import ModelLoaded, TensorEntry
from aegaeon_engine.weights import TORCH_DTYPES
from aegaeon_gpumem import EventTable, ShmRegion, Timeline

log = get_logger("cachemgr.mapped")


@dataclass(frozen=True)
class Registration:
    """A worker's lease: the unified KV region (read-write), the event table and its slots."""

    worker_id: str
    kv_region: ShmRegion
    event_table: EventTable
    event_slots: tuple[int, ...]
    slab_bytes: int

    @property
    def kv_tensor(self) -> torch.Tensor:
        """The whole KV region as a uint8 tensor (zero-copy)."""
        return self.kv_region.tensor

    def block(self, offset: int, block_bytes: int) -> torch.Tensor:
        """The bytes of the block at ``offset`` (a zero-copy uint8 view)."""
        return self.kv_region.tensor[offset : offset + block_bytes]

    def timeline(self, index: int = 0) -> Timeline:
        """The writer of this worker's ``index``-th event slot (one per copy stream)."""
        return Timeline(self.event_table, self.event_slots[index])

    def close(self) -> None:
        self.event_table.close()
        self.kv_region.close()


@dataclass(frozen=True)
class MappedModel:
    """A Model Cache region mapped read-only, laid out as the engine's ``weight_layout``."""

    name: str
    region: ShmRegion
    nbytes: int
    dtype: str
    tensors: tuple[TensorEntry, ...]
    load_s: float = 0.0
    hit: bool = False
    # page-locked for CUDA copies: "ro" (a read-only mapping), "rw" (the device
    # cannot pin read-only memory, so it is mapped read-write), "" (pageable)
    pinned: str = ""

    @classmethod
    def attach(cls, reply: ModelLoaded, populate: bool = False, pin: bool = False) -> MappedModel:
        """Map the region of ``reply`` (``populate``: every page now, see ``ShmRegion``;
        ``pin``: page-locked for CUDA copies where the device allows, see ``_pinned``)."""
        region = ShmRegion.attach(reply.region, readonly=True, populate=populate)
        pinned = ""
        if pin:
            region, pinned = _pinned(region, populate)
        return cls(
            reply.name,
            region,
            reply.nbytes,
            reply.dtype,
            tuple(reply.tensors),
            reply.load_s,
            reply.hit,
            pinned,
        )

    def with_reply(self, reply: ModelLoaded) -> MappedModel:
        return dataclasses.replace(self, load_s=reply.load_s, hit=reply.hit)

    @property
    def data(self) -> torch.Tensor:
        """The packed weights, ``nbytes`` uint8 (one flat copy scales a worker up)."""
        return self.region.tensor[: self.nbytes]

    def view(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a typed, shaped view (read-only memory: do not write); a
        block-quantized one (``q4_1``, ...) as its rows of blocks, uint8 of shape
        ``(rows, row bytes)``; an FP8 one as its slot's bytes (the codes, then the
        float32 row scales: ``aegaeon_engine.fp8.Fp8Tensor.over`` reads them)."""
        entry = next((t for t in self.tensors if t.name == name), None)
        if entry is None:
            raise KeyError(f"model {self.name!r} has no tensor {name!r}")
        raw = self.region.tensor[entry.offset : entry.offset + entry.nbytes]
        if entry.dtype == FP8:
            return raw
        if entry.dtype in QUANT_BLOCKS:
            rows = entry.shape[0]
            return raw.view(rows, quant_row_bytes(entry.dtype, entry.shape[-1]))
        return raw.view(TORCH_DTYPES[entry.dtype]).view(entry.shape)


def _pinned(region: ShmRegion, populate: bool) -> tuple[ShmRegion, str]:
    """``region`` page-locked (cudaHostRegister), read-only where the device can pin
    read-only memory, else mapped again read-write (the device's DMA needs the pages
    pinned for writing; losing the MMU's guard is the price of a full-speed
    scale-up). Where neither pins, the pageable mapping and ``""``."""
    from aegaeon_gpumem.cuda_host import pin_region

    pin, why_ro = pin_region(region)
    if pin is not None:
        return region, "ro"
    writable = ShmRegion.attach(region.name, readonly=False, populate=populate)
    pin, why_rw = pin_region(writable)
    if pin is not None:
        region.close()
        return writable, "rw"
    writable.close()
    log.warning("model_region_not_pinned", region=region.name, read_only=why_ro,
                read_write=why_rw)
    return region, ""
