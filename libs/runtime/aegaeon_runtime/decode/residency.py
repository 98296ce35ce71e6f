"""Moving decode requests' KV between the unified CPU cache and the device region.

Batches that do not fit on the device stay (or are put back) in the host
cache: before a batch's turn its requests are swapped in; when the device
region is full, requests of *other* batches are swapped out, those whose
turn comes last first (the batch that just ran). Every copy is asynchronous
with an event; see :mod:`aegaeon_runtime.kv`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aegaeon_common.transport import RemoteError
from aegaeon_gpumem import Event, OutOfBlocks

from aegaeon_runtime.clock import SYSTEM_CLOCK, Clock
from aegaeon_runtime.decode.seq import Seq
from aegaeon_runtime.port import WorkerPort


class KVCapacityError(RuntimeError):
    """A single request needs more device KV than the whole region has."""


class Residency:
    """Swap-in/out decisions and bookkeeping for one decode instance."""

    def __init__(self, worker: WorkerPort, clock: Clock = SYSTEM_CLOCK) -> None:
        self.worker = worker
        self.kv = worker.kv
        self.clock = clock
        self.num_swap_in = 0
        self.num_swap_out = 0
        self.control_s = 0.0  # the swaps' bookkeeping time, each charged to its sequence

    def accept(self, seq: Seq) -> None:
        """Take over the handoff's host blocks from the prefill instance (lease); once
        for the ``n`` sequences of a request that share them."""
        if seq.host_blocks:
            self.worker.cache.reassign_blocks(seq.host_blocks, self.worker.name, owner="")

    def _free_host(self, seq: Seq, event: Event | None, read: bool) -> None:
        """``seq`` no longer reads its host blocks: free them, unless other sequences of
        its request still will (a shared handoff goes with the last one; the swap-in
        copies run in order on one stream, so the last's event follows the others')."""
        shared = seq.host_shared
        seq.host_shared = None
        if shared is not None:
            shared.holders -= 1
            if read or shared.last_read is None:  # ``event`` (a swap-in) reads them last
                shared.last_read = event
            if shared.holders > 0:
                return
            event = shared.last_read
        self.kv.free_host(seq.host_blocks, event)

    def _alloc(self, seq: Seq, num_blocks: int, victims: Callable[[], Iterable[Seq]]) -> list[int]:
        """Device blocks for ``seq``, swapping victims out until they fit."""
        while True:
            try:
                return self.kv.alloc(seq.shape, num_blocks)
            except OutOfBlocks:
                victim = next(iter(victims()), None)
                if victim is None:
                    raise
                self.swap_out(victim)

    def swap_in(self, seq: Seq, victims: Callable[[], Iterable[Seq]]) -> None:
        """Bring ``seq``'s KV to the device (asynchronously; ``seq.ready()`` tells when).

        Room for its next write is allocated too. Raises KVCapacityError if it can
        never fit, OutOfBlocks if it does not fit now and nothing can be evicted.
        """
        if seq.on_device:
            return
        start, victims_s = self.clock.now(), self.control_s
        need = self._check_capacity(seq)
        num_host = len(seq.host_blocks)
        blocks = self._alloc(seq, need, victims)
        seq.ready_event = None
        if num_host:
            # The swap-in stream waits for the producer's copy (rule 2), not us.
            event = self.kv.swap_in(seq.shape, seq.host_blocks, blocks[:num_host],
                                    seq.host_event)
            # The host copy can go once the swap-in has read it (rule 3).
            self._free_host(seq, event, read=True)
            seq.ready_event = event
        seq.device_blocks = blocks
        seq.host_blocks, seq.host_event = [], None
        seq.on_device = True
        seq.num_swaps += 1
        self.num_swap_in += 1
        self._charge(seq, start, self.control_s - victims_s)  # the victims' swap-outs are theirs

    def swap_out(self, seq: Seq) -> None:
        """Put ``seq``'s KV back in the host cache and free its device blocks
        once the copy has read them."""
        if not seq.on_device:
            return
        start = self.clock.now()
        used = seq.shape.blocks_for(seq.num_tokens_in_kv)
        keep, spare = seq.device_blocks[:used], seq.device_blocks[used:]
        self.kv.free(seq.shape, spare, seq.ready_event)
        if keep:
            try:
                seq.host_blocks, seq.host_event = self.kv.swap_out(seq.shape, keep)
            except RemoteError:
                # The host cache is full: keep the KV where it is.
                seq.device_blocks = keep
                raise
        seq.device_blocks, seq.ready_event, seq.on_device = [], None, False
        self.num_swap_out += 1
        self._charge(seq, start)

    def _charge(self, seq: Seq, start: float, others_s: float = 0.0) -> None:
        """Charge ``seq``'s request the bookkeeping since ``start`` (paper Fig. 14's
        control overhead, its timings' ``kv_control_s``) but ``others_s``, charged to
        other sequences meanwhile."""
        spent = self.clock.now() - start - others_s
        seq.kv_control_s += spent
        self.control_s += spent

    def make_room(self, num_bytes: int, victims: Iterable[Seq]) -> int:
        """Swap ``victims`` out, in order, until at least ``num_bytes`` of their device
        blocks are on their way back to the pool (behind the copies' events); the
        bytes swapped out (0: no victim was on the device). RemoteError: the host
        cache is full (what was swapped out so far stays out)."""
        freed = 0
        for seq in victims:
            if freed >= num_bytes:
                break
            if not seq.on_device:
                continue
            held = len(seq.device_blocks) * seq.shape.block_bytes
            self.swap_out(seq)
            freed += held
        return freed

    def grow(self, seq: Seq, victims: Callable[[], Iterable[Seq]]) -> None:
        """Make sure ``seq`` has a block for its next write (KVCapacityError: it
        has outgrown the whole region)."""
        missing = seq.blocks_needed() - len(seq.device_blocks)
        if missing > 0:
            self._check_capacity(seq)
            seq.device_blocks += self._alloc(seq, missing, victims)

    def _check_capacity(self, seq: Seq) -> int:
        """The blocks ``seq``'s next step needs; KVCapacityError beyond the region."""
        need = seq.blocks_needed()
        capacity = self.kv.capacity_blocks(seq.shape)
        if need > capacity:
            raise KVCapacityError(
                f"request needs {need} KV blocks, the device region holds {capacity} of its shape"
            )
        return need

    def release(self, seq: Seq) -> None:
        """The request ended: free whatever KV it holds, wherever it is."""
        if seq.on_device:
            self.kv.free(seq.shape, seq.device_blocks, seq.ready_event)
        if seq.host_blocks:
            self._free_host(seq, seq.host_event, read=False)
        seq.device_blocks, seq.host_blocks = [], []
        seq.on_device = False
