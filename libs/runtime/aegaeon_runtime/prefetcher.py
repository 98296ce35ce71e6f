"""The switcher's background copier: one long-lived thread, cancellable copies.

A prefetch is a copy of a model's packed bytes into free arena space while
the active model serves (paper §5.2). One thread lives as long as the worker
(starting a thread per prefetch cost ~5% of a busy decode instance's time),
and a copy proceeds in chunks so that activating *another* model cancels it
within one chunk instead of waiting for bytes nobody will use.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from aegaeon_gpumem import Allocation

# Small enough to cancel within ~1-3 ms, large enough to copy at memcpy speed.
PREFETCH_CHUNK_BYTES = 16 << 20


class PrefetchCancelledError(Exception):
    """A prefetch copy stopped early because another model was activated."""


class PrefetchJob:
    """One model being copied into ``allocation`` (None: mapped in place; results set by
    the copier)."""

    def __init__(self, name: str, allocation: Allocation | None) -> None:
        self.name = name
        self.allocation = allocation
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.copy_s = 0.0
        self.in_place = False  # the bytes were still where they go: nothing was copied
        self.error: BaseException | None = None
        self.result: object = None  # what the copy function produced (bound views)

    def check(self) -> None:
        """Called between chunks; raises :class:`PrefetchCancelledError` once cancelled."""
        if self.cancelled.is_set():
            raise PrefetchCancelledError(self.name)


class Prefetcher:
    """Runs ``work(job)`` for each submitted job, in order, on one daemon thread."""

    def __init__(self, work: Callable[[PrefetchJob], None], name: str = "aegaeon-prefetch") -> None:
        self._work = work
        self._jobs: queue.SimpleQueue[PrefetchJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: PrefetchJob) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._work(job)
            except PrefetchCancelledError:
                pass
            except BaseException as exc:  # reported to whoever activates the model
                job.error = exc
            finally:
                job.done.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)
