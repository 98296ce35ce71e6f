"""The worker's one device allocation: weights arena below, KV region above.

    0                      weights_capacity                                   nbytes
    | active model | prefetched model | free | adapters |   KV region (slabs)  |
    ^ bump arena (BumpArena) -------------->  ^ adapter_offset ^ kv_offset

The adapter region (``adapter_bytes``, often 0) holds LoRA adapters of the
active model, bookkept by its user (aegaeon_runtime.adapters).

The buffer is allocated once at construction (on CUDA this is the single
cudaMalloc of the worker). After that nothing is freed to or requested from
torch's allocator: weights are bump-allocated (`alloc`/`reset`; `arena`),
the engine binds parameters to `view`s, and switching models is moving the
bump pointer. A model prefetched into the space right after the active one is
moved to the bottom with `promote`, an on-device copy.

The same code runs on every device; `device` is only passed to `torch.empty`.
"""

from __future__ import annotations

import torch

from aegaeon_gpumem.arena import DEFAULT_ALIGN, Allocation, ArenaStats, BumpArena
from aegaeon_gpumem.memcopy import byte_copy

# The usable buffer starts at an address that is a multiple of this, so the
# arena's relative alignments are absolute alignments too.
BASE_ALIGN = 4096


def promote_copy(buffer: torch.Tensor, src_offset: int, dst_offset: int, nbytes: int) -> int:
    """Move `nbytes` of `buffer` from `src_offset` down to `dst_offset`; return #copies.

    Overlap-safe: torch `copy_` on overlapping memory is undefined, so the move
    is a forward sequence of chunks of at most `src_offset - dst_offset` bytes.
    No single chunk overlaps itself, and chunk i writes only bytes below
    `src_offset + i*chunk`, which every later chunk has already passed (it
    reads at or above `src_offset + (i+1)*chunk`), so no unread source byte is
    overwritten. A small gap means many chunks (nbytes / gap copies).
    """
    if not 0 <= dst_offset <= src_offset:
        raise ValueError(f"promote moves down: need 0 <= dst {dst_offset} <= src {src_offset}")
    if src_offset + nbytes > buffer.numel():
        raise ValueError(f"source [{src_offset}, {src_offset + nbytes}) exceeds the buffer")
    gap = src_offset - dst_offset
    if gap == 0 or nbytes == 0:
        return 0
    copies = 0
    for start in range(0, nbytes, gap):
        size = min(gap, nbytes - start)
        dst = buffer[dst_offset + start : dst_offset + start + size]
        byte_copy(dst, buffer[src_offset + start : src_offset + start + size])
        copies += 1
    return copies


class DeviceBuffer:
    """One uint8 buffer on `device`: a bump-allocated weights arena and a KV region.

    Args:
        nbytes: total bytes of the buffer.
        kv_bytes: bytes of the KV region at the top; the weights arena gets
            the rest, `[0, nbytes - kv_bytes)`.
        device: torch device ("cpu", "cuda:0", ...).
        align: default alignment of weight allocations (bytes, power of two).
        prefault: zero the buffer at construction so its pages are resident
            (the memory is committed up front, like a cudaMalloc).
        adapter_bytes: bytes of the adapter region below the KV region (taken from
            the weights arena).
    """

    def __init__(
        self,
        nbytes: int,
        kv_bytes: int = 0,
        device: torch.device | str = "cpu",
        align: int = DEFAULT_ALIGN,
        prefault: bool = True,
        adapter_bytes: int = 0,
    ) -> None:
        room = nbytes - kv_bytes
        if nbytes <= 0 or not 0 <= kv_bytes <= nbytes or not 0 <= adapter_bytes <= room:
            raise ValueError(
                f"need nbytes > 0 and 0 <= kv_bytes <= nbytes and room for the adapter "
                f"region, got {nbytes}, {kv_bytes}, {adapter_bytes}"
            )
        raw = torch.empty(nbytes + BASE_ALIGN, dtype=torch.uint8, device=device)
        pad = -raw.data_ptr() % BASE_ALIGN
        buffer = raw[pad : pad + nbytes]
        if prefault:
            # Touch every page now: on the CPU a first-touch page fault made a
            # weight load 5-50x slower than a copy into resident memory.
            buffer.zero_()
        self._init(buffer, kv_bytes, align, adapter_bytes)

    @classmethod
    def over(
        cls, tensor: torch.Tensor, kv_bytes: int = 0, align: int = DEFAULT_ALIGN
    ) -> DeviceBuffer:
        """Manage an existing contiguous 1-D uint8 tensor (e.g. a shared-memory region)."""
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("DeviceBuffer.over needs a contiguous 1-D uint8 tensor")
        if not 0 <= kv_bytes <= tensor.numel():
            raise ValueError(f"kv_bytes {kv_bytes} exceeds the tensor's {tensor.numel()} bytes")
        self = cls.__new__(cls)
        self._init(tensor, kv_bytes, align)
        return self

    def _init(self, buffer: torch.Tensor, kv_bytes: int, align: int,
              adapter_bytes: int = 0) -> None:
        self._buffer = buffer
        self._kv_offset = buffer.numel() - kv_bytes
        self._kv_bytes = kv_bytes
        # rounded down to a page so the arena's end and the region's start stay aligned
        self._adapter_offset = self._kv_offset - adapter_bytes // BASE_ALIGN * BASE_ALIGN
        self._arena = BumpArena(self._adapter_offset, align)

    # -- layout --------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device the buffer lives on."""
        return self._buffer.device

    @property
    def nbytes(self) -> int:
        """Total bytes (weights arena + KV region)."""
        return self._buffer.numel()

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a uint8 tensor."""
        return self._buffer

    @property
    def weights_capacity(self) -> int:
        """Bytes of the weights arena (= `kv_offset` less the adapter region)."""
        return self._adapter_offset

    @property
    def adapter_region(self) -> torch.Tensor:
        """The adapter region as a uint8 view (empty when there is none)."""
        return self._buffer[self._adapter_offset : self._kv_offset]

    @property
    def kv_offset(self) -> int:
        """Buffer offset of the KV region's first byte."""
        return self._kv_offset

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV region."""
        return self._kv_bytes

    @property
    def kv_region(self) -> torch.Tensor:
        """The KV region as a uint8 view (offsets into it are slab-allocator offsets)."""
        return self._buffer[self._kv_offset :]

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of buffer bytes [offset, offset + nbytes) (no copy)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + nbytes}) is outside [0, {self.nbytes})")
        return self._buffer[offset : offset + nbytes]

    # -- weights arena -------------------------------------------------------

    @property
    def arena(self) -> BumpArena:
        """The weights arena's bookkeeping."""
        return self._arena

    def alloc(self, nbytes: int, align: int | None = None) -> Allocation:
        """Bump-allocate `nbytes` in the weights arena (OutOfDeviceMemory if full).

        Prefetch placement: allocating while the active model is live places
        the next model right after it; `promote` later moves it to offset 0.
        """
        return self._arena.alloc(nbytes, align)

    def fits(self, nbytes: int, align: int | None = None) -> bool:
        """True if `alloc(nbytes, align)` would succeed (e.g. room to prefetch)."""
        return self._arena.fits(nbytes, align)

    def reset(self) -> None:
        """Free every weight allocation (scale-down)."""
        self._arena.reset()

    def stats(self) -> ArenaStats:
        """Occupancy of the weights arena."""
        return self._arena.stats()

    def promote(self, src_offset: int, nbytes: int, dst_offset: int = 0) -> Allocation:
        """Move a prefetched model's bytes down to `dst_offset`; return its new allocation.

        The copy is overlap-safe (see `promote_copy`) and runs on the device's
        current stream. Afterwards the arena holds the allocations below
        `dst_offset` plus the returned one; everything that was above is
        released (the old active model was overwritten, the prefetch slot is
        free for the next prefetch).
        """
        if src_offset + nbytes > self._adapter_offset:
            raise ValueError(
                f"source [{src_offset}, {src_offset + nbytes}) is outside the weights arena"
                f" [0, {self._adapter_offset})"
            )
        promote_copy(self._buffer, src_offset, dst_offset, nbytes)
        allocation = Allocation(dst_offset, nbytes)
        self._arena.set_top(allocation)
        return allocation

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"DeviceBuffer({self.nbytes} bytes on {self.device}, weights {s.used_bytes}/"
            f"{s.capacity_bytes}, kv {self._kv_bytes} at {self._kv_offset})"
        )
