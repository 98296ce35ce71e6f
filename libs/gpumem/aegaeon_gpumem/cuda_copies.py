"""The CUDA backend's copies: a torch.cuda.Stream copy stream and the pinned stage
buffer for pipelined host -> device weight loads (thin seams; need CUDA to run).

Host -> device from pageable memory (the Model Cache is shared memory, not
pinned) goes through a page-locked stage buffer split in slots: the host
memcpy of chunk i+1 into one slot overlaps the DMA of chunk i from another,
and a slot is reused only after the event of its last DMA completed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from aegaeon_gpumem.copies import CopyStream
from aegaeon_gpumem.cuda_events import CudaEvent
from aegaeon_gpumem.errors import EventTimeoutError
from aegaeon_gpumem.event_table import EventTable, Timeline
from aegaeon_gpumem.events import Event, EventHandle

CUDA_CHUNK_BYTES = 32 << 20
STAGE_SLOTS = 2


class CudaCopyStream(CopyStream):
    """A copy stream on a `torch.cuda.Stream` (the CopyStream interface, CUDA backend).

    Events are interprocess CUDA events; `wait_event` on a CUDA event is
    cudaStreamWaitEvent (no host blocking); on a CPU event (another backend's
    producer) it blocks the caller until that event completes.

    With a timeline slot (``table``, ``slot``: a worker's, from its cachemgr lease)
    each event also gets a host mirror: a daemon thread waits for the stream's events
    in order and signals the slot after each, so a process without a GPU (the
    cachemgr, with ``CUDA_VISIBLE_DEVICES=""``) knows when a copy finished from one
    8-byte read (``events.open_host_event``).
    """

    def __init__(self, device: torch.device | str | int, table: EventTable | None = None,
                 slot: int | None = None) -> None:  # fmt: skip
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # per other device: a stream there for copies of its memory (a tensor-parallel
        # group's rank 0 moves its followers' KV, aegaeon_runtime.kv)
        self._peers: dict[int, torch.cuda.Stream] = {}
        self._timeline = Timeline(table, slot) if table is not None and slot is not None else None
        self._mirrored: queue.SimpleQueue[tuple[CudaEvent, int] | None] = queue.SimpleQueue()
        self._record_lock = threading.Lock()  # values reach the mirror thread in order
        self._mirror_thread: threading.Thread | None = None
        if self._timeline is not None:
            self._mirror_thread = threading.Thread(target=self._mirror, daemon=True,
                                                   name="aegaeon-cuda-mirror")  # fmt: skip
            self._mirror_thread.start()

    def _mirror(self) -> None:
        """Signal each event's host mirror once it completed, in record order."""
        assert self._timeline is not None
        while True:
            item = self._mirrored.get()
            if item is None:
                return
            event, value = item
            event.synchronize()
            self._timeline.signal(value)

    @property
    def torch_stream(self) -> torch.cuda.Stream:
        """The underlying stream."""
        return self._stream

    def copy_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue the copies in order (asynchronous for device and pinned host memory),
        behind the work the caller already enqueued on its current stream: a swap-out
        must not read KV blocks before the prefill writing them has run.

        A copy of another device's memory (a follower's KV region, mapped by CUDA IPC)
        runs on a stream of that device, ordered after this stream's work so far and
        joined back into it: this stream's next event covers it too. (A follower's own
        kernels that wrote that memory finished before rank 0's collective that ended
        the step: the caller's current stream, waited on here, has passed it.)"""
        own = self._stream.device
        self._stream.wait_stream(torch.cuda.current_stream(own))
        local = [(d, s) for d, s in copies if _device_of(d, s) in (None, own.index)]
        with torch.cuda.stream(self._stream):
            for dst, src in local:
                dst.copy_(src, non_blocking=True)
        remote: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in copies:
            index = _device_of(dst, src)
            if index is not None and index != own.index:
                remote.setdefault(index, []).append((dst, src))
        for index, pairs in remote.items():
            side = self._peers.get(index)
            if side is None:
                side = self._peers[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            side.wait_stream(self._stream)
            with torch.cuda.stream(side):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            self._stream.wait_stream(side)

    def record(self) -> Event:
        """Record an interprocess event after the work enqueued so far (with its host
        mirror when the stream has a timeline slot)."""
        line = self._timeline
        if line is None:
            return CudaEvent.record(self._stream)
        with self._record_lock:
            value = line.issue()
            mirror = EventHandle("cpu", table=line.table.name, slot=line.slot, value=value)
            event = CudaEvent.record(self._stream, mirror)
            self._mirrored.put((event, value))
        return event

    def wait_event(self, event: Event, timeout_s: float | None = None) -> None:
        """Order later work after `event` (see class docstring)."""
        if isinstance(event, CudaEvent):
            event.wait_on(self._stream)
        elif not event.wait(timeout_s):
            raise EventTimeoutError(f"waited {timeout_s} s for {event!r}")

    def synchronize(self) -> None:
        """Block until the stream is idle."""
        self._stream.synchronize()

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait for queued work and stop the mirror thread (the stream itself needs no
        teardown)."""
        if timeout_s is None:
            self._stream.synchronize()
            done = True
        else:
            done = self.record().wait(timeout_s)
        if self._mirror_thread is not None:
            self._mirrored.put(None)
            self._mirror_thread.join(timeout_s)
        return done


def _device_of(dst: torch.Tensor, src: torch.Tensor) -> int | None:
    """The CUDA device a copy's device side is on (None: a host-to-host copy)."""
    for tensor in (src, dst):
        if tensor.device.type == "cuda":
            return tensor.device.index
    return None


class StageBuffer:
    """Page-locked host memory in `num_slots` slots of `slot_bytes` for staging DMAs."""

    def __init__(self, slot_bytes: int = CUDA_CHUNK_BYTES, num_slots: int = STAGE_SLOTS) -> None:
        self.slot_bytes = slot_bytes
        self._host = torch.empty(slot_bytes * num_slots, dtype=torch.uint8, pin_memory=True)
        self._slots = [self._host[i * slot_bytes : (i + 1) * slot_bytes] for i in range(num_slots)]
        self._lock = threading.Lock()  # one pipelined load at a time per stage buffer

    def load(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Copy host `src` to device `dst` (1-D uint8, equal sizes) through the slots; blocks
        until the last DMA finished."""
        pending: list[torch.cuda.Event | None] = [None] * len(self._slots)
        with self._lock:
            for i, start in enumerate(range(0, src.numel(), self.slot_bytes)):
                size = min(self.slot_bytes, src.numel() - start)
                k = i % len(self._slots)
                previous = pending[k]
                if previous is not None:
                    previous.synchronize()  # the slot's last DMA has read it
                slot = self._slots[k][:size]
                slot.copy_(src[start : start + size])  # pageable -> pinned (host memcpy)
                with torch.cuda.stream(stream):
                    dst[start : start + size].copy_(slot, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                pending[k] = event
            stream.synchronize()


_stages: dict[int, StageBuffer] = {}
_streams: dict[int, torch.cuda.Stream] = {}
_stage_lock = threading.Lock()


def _stream_for(device: torch.device) -> torch.cuda.Stream:
    """The device's load stream (weight loads and prefetches, one at a time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _stage_lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return _streams[index]


def _stage_for(device: torch.device) -> tuple[StageBuffer, torch.cuda.Stream]:
    stream = _stream_for(device)
    index = stream.device.index or 0
    with _stage_lock:
        if index not in _stages:
            _stages[index] = StageBuffer()
        return _stages[index], stream


def copy_chunked_cuda(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int | None) -> None:
    """Byte copy where at least one side is on CUDA (1-D uint8, equal sizes); blocking.

    Pageable host -> device goes through the device's stage buffer (its slot
    size, not `chunk_bytes`, sets the pipeline chunk); pinned host or device
    sources are one asynchronous copy followed by a synchronize.
    """
    device = dst.device if dst.device.type == "cuda" else src.device
    # On the load stream, synchronized alone: on the default stream (or with a
    # whole-device synchronize) a prefetch would wait for every decode kernel
    # running beside it. It starts behind the work already queued on the
    # caller's current stream, which may still read the bytes it overwrites.
    stream = _stream_for(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    if dst.device.type == "cuda" and src.device.type == "cpu" and not src.is_pinned():
        stage, _ = _stage_for(dst.device)
        stage.load(dst, src, stream)
        return
    del chunk_bytes  # a single DMA needs no chunking
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()
