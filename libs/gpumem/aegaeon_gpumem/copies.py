"""Copy streams and the copies that run on them (KV blocks, chunked weight loads).

A `CopyStream` runs copies asynchronously and in submission order, records
events after them, and can wait for another process's event before running
later work (cudaStreamWaitEvent), so a swap-in stream waits for the
producer's swap-out without blocking the caller.

CPU backend (`CpuCopyStream`): one daemon worker thread per stream drains a
queue of jobs in order (torch `copy_` releases the GIL, so copies overlap
with Python work); its events are a slot of a shared timeline table, stored
by the worker after the jobs before them finished. CUDA backend: a
`torch.cuda.Stream` (`cuda_copies.CudaCopyStream`).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

import torch

from aegaeon_gpumem.errors import CopyStreamError, EventTimeoutError
from aegaeon_gpumem.event_table import EventTable, Timeline
from aegaeon_gpumem.events import CpuEvent, Event
from aegaeon_gpumem.memcopy import byte_copy

CopyPair = tuple[int, int, int]  # (src_offset, dst_offset, nbytes)


class CopyStream(ABC):
    """An ordered queue of copies with events (see module docstring)."""

    @abstractmethod
    def copy_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Enqueue `dst.copy_(src)` for each (dst, src), in order, as one job."""

    @abstractmethod
    def record(self) -> Event:
        """An event that completes once everything enqueued so far has run."""

    @abstractmethod
    def wait_event(self, event: Event, timeout_s: float | None = None) -> None:
        """Make work enqueued after this call wait until `event` completes."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until everything enqueued so far has run; raise if the stream failed."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue `dst.copy_(src)`."""
        self.copy_many([(dst, src)])

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish queued work and stop (idempotent); False if `timeout_s` ran out first."""
        return True


def _check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Validated at submission so the worker never fails on a bad request.
    if dst.shape != src.shape:
        raise ValueError(f"copy shape mismatch: dst {tuple(dst.shape)}, src {tuple(src.shape)}")


_Job = tuple[Callable[[], None], bool]  # (function, is a barrier)


class CpuCopyStream(CopyStream):
    """A CPU copy stream: a daemon worker thread and a timeline slot.

    Args:
        table: a read-write attachment of the event table.
        slot: the slot this stream owns (one writer per slot).
        name: the worker thread's name.

    If a job fails (an event wait timing out, a copy raising), the stream is
    failed: later jobs are skipped, their events never complete, and
    `record`/`synchronize` raise CopyStreamError naming the cause.
    """

    def __init__(self, table: EventTable, slot: int, name: str = "aegaeon-copy") -> None:
        self._timeline = Timeline(table, slot)
        # None stops the worker.
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._error: Exception | None = None
        # Issuing an event value and enqueueing its signal are one step, so
        # signals reach the worker in value order even with many submitters.
        self._record_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def timeline(self) -> Timeline:
        """The slot this stream signals."""
        return self._timeline

    def _submit(self, job: Callable[[], None], barrier: bool = False) -> None:
        if self._closed:
            raise CopyStreamError("copy stream is closed")
        self._jobs.put((job, barrier))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, barrier = item
            if self._error is not None and not barrier:
                continue  # failed: skip work, but still release synchronize() callers
            try:
                job()
            except Exception as exc:
                # Not swallowed: like a Future, the failure is re-raised to the
                # submitter (record/synchronize raise CopyStreamError from it),
                # and the stream stops running work, so no event after it lies.
                self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CopyStreamError(f"copy stream failed: {self._error}") from self._error

    def copy_many(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in copies:
            _check_copy(dst, src)
        pairs = list(copies)

        def job() -> None:
            for dst, src in pairs:
                byte_copy(dst, src)

        self._submit(job)

    def launch_host_func(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the worker in stream order (cudaLaunchHostFunc's analogue)."""
        self._submit(fn)

    def record(self) -> Event:
        self._raise_if_failed()
        with self._record_lock:
            value = self._timeline.issue()
            self._submit(lambda: self._timeline.signal(value))
        return CpuEvent(self._timeline.table, self._timeline.slot, value)

    def wait_event(self, event: Event, timeout_s: float | None = None) -> None:
        if event.query():
            return  # already complete: nothing to order against

        def job() -> None:
            if not event.wait(timeout_s):
                raise EventTimeoutError(f"copy stream waited {timeout_s} s for {event!r}")

        self._submit(job)

    def synchronize(self) -> None:
        done = threading.Event()
        self._submit(done.set, barrier=True)
        done.wait()
        self._raise_if_failed()

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish queued work and stop the worker (idempotent).

        Returns False if the worker is still busy after `timeout_s` (e.g.
        waiting for an event that never completes; it is a daemon thread).
        """
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def coalesce(pairs: Iterable[CopyPair]) -> list[CopyPair]:
    """Sort (src_offset, dst_offset, nbytes) copies by source and merge runs that are
    contiguous in both source and destination (block i+1 follows block i in both)."""
    merged: list[CopyPair] = []
    for src, dst, nbytes in sorted(pairs):
        if nbytes <= 0:
            continue
        if merged:
            m_src, m_dst, m_n = merged[-1]
            if m_src + m_n == src and m_dst + m_n == dst:
                merged[-1] = (m_src, m_dst, m_n + nbytes)
                continue
        merged.append((src, dst, nbytes))
    return merged


def copy_blocks(
    stream: CopyStream,
    src_region: torch.Tensor,
    dst_region: torch.Tensor,
    pairs: Iterable[CopyPair],
) -> int:
    """Enqueue block copies between two uint8 regions as one job; return the copy count.

    `pairs` are (src_offset, dst_offset, nbytes); adjacent pairs are coalesced
    (`coalesce`), so a run of consecutive blocks is one memcpy. Callers must
    not pass overlapping destinations.
    """
    merged = coalesce(pairs)
    src_len, dst_len = src_region.numel(), dst_region.numel()
    for src, dst, nbytes in merged:
        if src < 0 or dst < 0 or src + nbytes > src_len or dst + nbytes > dst_len:
            raise ValueError(
                f"block copy {src}->{dst} of {nbytes} bytes is outside the regions"
                f" ({src_len}, {dst_len} bytes)"
            )
    stream.copy_many([(dst_region[d : d + n], src_region[s : s + n]) for s, d, n in merged])
    return len(merged)
