"""What an instance holds for its requests, as the proxy's ``/v1/aegaeon/stats`` shows it.

Two readers. The heartbeat (every 0.5 s, on the event loop) reads it whole; the
compute thread reads it each time a message ends a request or hands it on
(``StepTokens`` with a finish, ``PrefillDone``, ``RequestFailed``): after that
request's KV was freed and its queue entry dropped, and before the message leaves,
so the message carries it and the proxy counts it before it answers the client. A
request that has returned is then never counted on the instance that ended it
(``kv_blocks_in_use`` and ``open_sequences`` read 0 on an idle node at once, not a
heartbeat later).

Each compute-thread reading takes a new ``version``; the heartbeat reads the version
before the numbers, so its numbers are never older than its version says, and the
proxy keeps the reading of the highest version (the two travel on different
sockets) of the process that said hello last (``INCARNATION``).
"""

from __future__ import annotations

from collections.abc import Callable

from aegaeon_common.messages.structs import Holdings
from aegaeon_gpumem import KVBlockPool

from aegaeon_runtime.incarnation import INCARNATION

__all__ = ["HoldingsBook", "Reading", "no_reading", "used_blocks"]

# What a loop's parts call after a request's end or hand-on: the reading its message
# carries (None: nobody keeps a book, as in a test that drives a part alone).
Reading = Callable[[], Holdings | None]


def no_reading() -> Holdings | None:
    return None


class HoldingsBook:
    """``kv_blocks``: device KV blocks in use now (any thread); ``open_sequences``: the
    requests queued or in the work list, as the compute thread last published them."""

    def __init__(self, kv_blocks: Callable[[], int], open_sequences: Callable[[], int]) -> None:
        self._kv_blocks = kv_blocks
        self._open_sequences = open_sequences
        self.version = 0  # written by the compute thread only

    def after_change(self) -> Holdings:
        """Compute thread, once a request's end or hand-on is done (its KV freed, the
        load published): a new version, and the reading its message carries."""
        self.version += 1
        return self.read()

    def read(self) -> Holdings:
        """Any thread: the version first, then the numbers (never older than it)."""
        version = self.version
        return Holdings(version, self._kv_blocks(), self._open_sequences(), INCARNATION)


def used_blocks(pool: KVBlockPool) -> int:
    """Device KV blocks in use in ``pool``: live ones, and those on the move list (a copy
    still reads them)."""
    return sum(shape.used_blocks for shape in pool.stats().slabs.shapes.values())
