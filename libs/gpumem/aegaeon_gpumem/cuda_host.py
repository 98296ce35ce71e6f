"""Page-locking host memory this process already maps (cudaHostRegister), a thin seam.

A CUDA worker copies weights from the shared Model Cache and KV blocks to and
from the unified CPU cache. From pageable memory every such copy goes through
a staging buffer (``cuda_copies.StageBuffer``: a host memcpy, then the DMA);
from registered memory it is one DMA at the link's speed, and a KV copy is
truly asynchronous. Registration is per process and per mapping: each worker
pins its own mappings of the cachemgr's segments.

The calls go to the CUDA runtime torch loaded (found in ``/proc/self/maps``)
through ctypes, because a refused registration leaves the runtime's
per-thread "last error" set, and torch's next kernel launch would raise it as
its own failure: every failed call here is followed by ``cudaGetLastError``.
A region whose pinning is refused simply stays pageable (slower, correct).

A pin ends when the mapping's last reference goes (``weakref.finalize`` on
its ``mmap``): a region can outlive its ``ShmRegion`` under live tensors
(``aegaeon_gpumem.shm``), and a copy may still read it until then.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

from aegaeon_gpumem.shm import ShmRegion

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 0x01  # pinned for every CUDA context of the process
HOST_REGISTER_READ_ONLY = 0x08  # the device only reads it (a PROT_READ mapping)
ATTR_HOST_REGISTER_SUPPORTED = 99  # cudaDevAttrHostRegisterSupported
ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported


@dataclass(frozen=True)
class HostPin:
    """A registered range: where, how many bytes, with which flags."""

    ptr: int
    nbytes: int
    flags: int

    @property
    def readonly(self) -> bool:
        return bool(self.flags & HOST_REGISTER_READ_ONLY)


# the pin of each region object (pin_region is idempotent)
_pins: weakref.WeakKeyDictionary[ShmRegion, HostPin] = weakref.WeakKeyDictionary()


@functools.cache
def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded into this process, or None (no CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # type: ignore[no-untyped-call]
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libcudart" in Path(path).name:
            lib = ctypes.CDLL(path)
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaDeviceGetAttribute.argtypes = [
                ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            return lib
    return None


def _error(lib: ctypes.CDLL, code: int) -> str:
    lib.cudaGetLastError()  # clear it: torch's next launch check would raise it
    name = lib.cudaGetErrorString(code)
    return f"cudaError {code} ({name.decode() if name else '?'})"


def device_attribute(attr: int, device: int = 0) -> int | None:
    """``cudaDeviceGetAttribute``, or None without CUDA or on an error."""
    lib = cudart()
    if lib is None:
        return None
    value = ctypes.c_int(0)
    code = lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, device)
    if code != 0:
        _error(lib, code)
        return None
    return value.value


def register(ptr: int, nbytes: int, flags: int) -> tuple[HostPin | None, str]:
    """Page-lock ``[ptr, ptr + nbytes)``; (the pin, '') or (None, why it was refused)."""
    lib = cudart()
    if lib is None:
        return None, "no CUDA runtime in this process"
    code = lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, flags)
    if code != 0:
        return None, _error(lib, code)
    return HostPin(ptr, nbytes, flags), ""


def unregister(pin: HostPin) -> None:
    """End a pin (errors are logged and cleared, never raised: this runs in finalizers)."""
    lib = cudart()
    if lib is None:
        return
    code = lib.cudaHostUnregister(ctypes.c_void_p(pin.ptr))
    if code != 0:
        log.warning("cudaHostUnregister of %#x failed: %s", pin.ptr, _error(lib, code))


def pin_region(region: ShmRegion) -> tuple[HostPin | None, str]:
    """Page-lock the whole mapping of ``region`` until its last reference goes.

    Read-only mappings need the read-only flag (the driver cannot pin them for
    writing); where the device refuses it, the answer is (None, why) and the
    region stays pageable. Idempotent per region object.
    """
    existing = _pins.get(region)
    if existing is not None:
        return existing, ""
    ptr, nbytes = region.tensor.data_ptr(), region.nbytes
    flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if region.readonly else 0)
    pin, why = register(ptr, nbytes, flags)
    if pin is None:
        return None, why
    ender = weakref.finalize(region.mapping, unregister, pin)
    ender.atexit = False  # the process's exit releases its pins; CUDA may be gone by then
    _pins[region] = pin
    return pin, ""
