"""The KV handoffs an instance sent, kept until a new proxy says it started.

A prefill (or a decode instance that prefills: roles moving, hybrid) leases the
host blocks of each handoff to itself and sends ``PrefillDone`` to the proxy;
the decode instance the proxy places the request on takes the lease over when it
accepts it (``ReassignBlocks``). A proxy that dies between the two leaves the blocks
leased here for good: its successor never hears of the request. On
``ProxyStarted`` (sent before any work of the new proxy) every handoff in this
record is from the old proxy: those still leased to this instance are freed
(``FreeBlocks`` with its own name). The cachemgr refuses a free of blocks whose
lease moved to another owner (``not_owner``) or that were freed already
(``bad_request``), so a handoff a decode instance claimed is left alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from aegaeon_common.messages.structs import EventSpec, KVHandoff
from aegaeon_common.transport import RemoteError

from aegaeon_runtime.port import HostCachePort

MAX_RECORDED = 4096  # handoffs remembered (oldest forgotten first)


class SentHandoffs:
    """request id -> the handoff's host blocks (and the copy's event), bounded."""

    def __init__(self, limit: int = MAX_RECORDED) -> None:
        self.limit = limit
        self._sent: OrderedDict[str, tuple[list[int], EventSpec | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sent)

    def record(self, request_id: str, handoff: KVHandoff | None) -> None:
        if handoff is None or not handoff.block_offsets:
            return
        self._sent[request_id] = (list(handoff.block_offsets), handoff.event)
        self._sent.move_to_end(request_id)
        while len(self._sent) > self.limit:
            self._sent.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """This instance claimed the handoff itself (a hybrid instance decoding what it
        prefilled): its sequence owns the blocks now."""
        self._sent.pop(request_id, None)

    def free_one(
        self, request_id: str, cache: HostCachePort, in_use: Collection[int] = ()
    ) -> bool:
        """Free ``request_id``'s handoff if it is still leased here (its placement was
        given up); forget it. False when there was none, a decode instance claimed
        it, or its blocks were freed and handed out again since: to a newer handoff
        (the newer record is the truth for those blocks) or to this instance's own
        sequences (``in_use``: the host blocks a hybrid instance's sequences hold)."""
        if request_id not in self._sent:
            return False
        ids = list(self._sent)
        offsets, event = self._sent.pop(request_id)
        blocks = set(offsets)
        if not blocks.isdisjoint(in_use):
            return False
        for newer in ids[ids.index(request_id) + 1 :]:
            if not blocks.isdisjoint(self._sent[newer][0]):
                return False
        try:
            cache.free_blocks(list(offsets), event)
        except (RemoteError, TimeoutError):  # claimed, freed already, or no cachemgr
            return False
        return True

    def free_unclaimed(self, cache: HostCachePort) -> int:
        """Free every recorded handoff still leased to this instance; forget them all.
        Returns how many were freed.

        Newest first: a handoff whose blocks overlap a newer one's was freed before
        (its blocks were allocated again), so it is skipped; the newer record is the
        truth for those blocks. Call it on the compute thread, in command order, so
        no handoff of the new proxy can be recorded or leased here yet."""
        freed = 0
        seen: set[int] = set()
        for offsets, event in reversed(list(self._sent.values())):
            stale = not seen.isdisjoint(offsets)
            seen.update(offsets)
            if stale:
                continue
            try:
                cache.free_blocks(list(offsets), event)
            except RemoteError:  # not_owner: claimed; bad_request: freed already
                continue
            except TimeoutError:  # no cachemgr: its restart frees every lease anyway
                break
            freed += 1
        self._sent.clear()
        return freed
