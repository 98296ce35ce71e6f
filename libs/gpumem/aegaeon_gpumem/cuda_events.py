"""The CUDA backend's events: IPC CUDA events through torch (a thin seam).

cudaEventRecord / cudaEventQuery / cudaStreamWaitEvent / cudaIpcGetEventHandle
/ cudaIpcOpenEventHandle map to `torch.cuda.Event(interprocess=True)`,
`.record(stream)`, `.query()`, `stream.wait_event(ev)`, `.ipc_handle()` and
`torch.cuda.Event.from_ipc_handle(device, handle)`.

A process cannot open its own IPC event handle (CUDA returns an error), so
events recorded here are kept in a local table by handle, and `open_event`
answers a local handle from it (the paper's artifact does the same). The
table holds weak references: an event nobody holds any more cannot be
waited on by this process, and other processes hold their own opened copy.

Lifetime across processes: using an imported event after its exporter
destroyed it is undefined (cuIpcOpenEventHandle), and an exporter drops an
event as soon as its own bookkeeping is done with it (a prefill's swap-out
event once the copy finished and the device blocks were reclaimed), maybe
before the consumer (the decode instance, the cachemgr) even opened it. So
an exported event is kept alive here for ``KEEP_EXPORTED_S`` after its
handle was last taken, and an importer that finds the event already
complete when it opens it keeps no CUDA event at all (``Event.completed()``),
so later waits on it, seconds or minutes on, never touch a dead event.

Imported by the package `__init__`, which registers the "cuda" opener; all
torch.cuda calls happen lazily, so importing on a CPU-only build is safe.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import torch

from aegaeon_gpumem.events import OPENERS, Event, EventHandle

KEEP_EXPORTED_S = 60.0
MAX_KEPT = 1 << 16  # a bound on the kept events, whatever the rate of exports

_local: weakref.WeakValueDictionary[bytes, CudaEvent] = weakref.WeakValueDictionary()
_exported: deque[tuple[float, CudaEvent]] = deque()
_exported_lock = threading.Lock()


def _keep_exported(event: CudaEvent) -> None:
    """Hold ``event`` for ``KEEP_EXPORTED_S`` (module docstring); drop the expired ones."""
    now = time.monotonic()
    with _exported_lock:
        _exported.append((now + KEEP_EXPORTED_S, event))
        while _exported and (_exported[0][0] < now or len(_exported) > MAX_KEPT):
            _exported.popleft()


class CudaEvent(Event):
    """A torch CUDA event with an IPC handle (interprocess, no timing)."""

    __slots__ = ("__weakref__", "_device", "_event", "_handle", "_mirror")

    def __init__(self, event: torch.cuda.Event, device: int, ipc_handle: bytes | None,
                 mirror: EventHandle | None = None) -> None:  # fmt: skip
        self._event = event
        self._device = device
        self._handle = ipc_handle
        self._mirror = mirror  # its host mirror's (table, slot, value), if its stream has one

    @classmethod
    def record(cls, stream: torch.cuda.Stream, mirror: EventHandle | None = None) -> CudaEvent:
        """Create an interprocess event and record it on `stream`; ``mirror``: the CPU
        event its stream signals once this one completed (``cuda_copies``)."""
        # torch.cuda.Event's methods are untyped; the ignores below are only that.
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        self = cls(event, stream.device.index or 0, None, mirror)
        _local[self.ipc_handle()] = self
        return self

    def synchronize(self) -> None:
        """Block until the event completed (the mirror thread's wait)."""
        self._event.synchronize()

    @property
    def device(self) -> int:
        """CUDA device index the event belongs to."""
        return self._device

    def ipc_handle(self) -> bytes:
        """The raw CUDA IPC event handle."""
        if self._handle is None:
            self._handle = bytes(self._event.ipc_handle())  # type: ignore[no-untyped-call]
        return self._handle

    def query(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self, timeout_s: float | None = None) -> bool:
        if timeout_s is None:
            self._event.synchronize()
            return True
        return super().wait(timeout_s)

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """Make later work on `stream` wait for this event (cudaStreamWaitEvent)."""
        stream.wait_event(self._event)

    def handle(self) -> EventHandle:
        """The IPC handle (with its host mirror, if any); the event is kept alive for other
        processes (module docstring)."""
        _keep_exported(self)
        mirror = self._mirror
        if mirror is None:
            return EventHandle("cuda", handle=self.ipc_handle(), device=self._device)
        return EventHandle("cuda", table=mirror.table, slot=mirror.slot, value=mirror.value,
                           handle=self.ipc_handle(), device=self._device)  # fmt: skip

    def __repr__(self) -> str:
        return f"CudaEvent(device={self._device})"


def open_cuda_event(handle: EventHandle) -> Event:
    """Open a CUDA event handle: this process's own events from the local table; another
    process's, already complete, as ``Event.completed()`` (module docstring)."""
    local = _local.get(handle.handle)
    if local is not None:
        return local
    event = torch.cuda.Event.from_ipc_handle(handle.device, handle.handle)  # type: ignore[no-untyped-call]
    if event.query():
        return Event.completed()
    return CudaEvent(event, handle.device, handle.handle)


OPENERS["cuda"] = open_cuda_event
