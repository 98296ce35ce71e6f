"""The handoffs an instance sent: one freed when its placement is given up, none freed
twice, none freed once a decode instance claimed it or its blocks went to a newer one."""

from __future__ import annotations

from aegaeon_common.messages.common import ErrorReply
from aegaeon_common.messages.structs import EventSpec, KVHandoff, KVShapeSpec
from aegaeon_common.transport import RemoteError
from aegaeon_runtime.handoffs import SentHandoffs

SHAPE = KVShapeSpec(2, 2, 8, 4, "float32")


class Leases:
    """The cachemgr's lease check, as the host cache port sees it: blocks leased to
    ``me`` are freed; any other owner's are refused (``not_owner``)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.owner: dict[int, str] = {}
        self.freed: list[list[int]] = []

    def lease(self, offsets: list[int], owner: str) -> None:
        self.owner.update(dict.fromkeys(offsets, owner))

    def reassign_blocks(self, offsets: list[int], new_owner: str, owner: str | None = None) -> int:
        self.lease(offsets, new_owner)
        return len(offsets)

    def free_blocks(self, offsets: list[int], event: EventSpec | None = None) -> object:
        if any(self.owner.get(o) != self.me for o in offsets):
            raise RemoteError(ErrorReply("not_owner", f"{offsets} are not {self.me}'s"))
        for o in offsets:
            del self.owner[o]
        self.freed.append(list(offsets))
        return None


def _sent(handoffs: SentHandoffs, cache: Leases, rid: str, offsets: list[int]) -> None:
    cache.lease(offsets, cache.me)
    handoffs.record(rid, KVHandoff(SHAPE, offsets, 8))


def test_an_unclaimed_handoff_is_freed_once() -> None:
    cache, handoffs = Leases("prefill-0"), SentHandoffs()
    _sent(handoffs, cache, "a", [1, 2])
    assert handoffs.free_one("a", cache)
    assert cache.freed == [[1, 2]]
    assert not handoffs.free_one("a", cache)  # forgotten: a second cancel frees nothing
    assert not handoffs.free_one("never-sent", cache)


def test_a_claimed_handoff_is_left_to_its_decode_instance() -> None:
    cache, handoffs = Leases("prefill-0"), SentHandoffs()
    _sent(handoffs, cache, "a", [1, 2])
    cache.reassign_blocks([1, 2], "decode-0")
    assert not handoffs.free_one("a", cache)
    assert cache.owner == {1: "decode-0", 2: "decode-0"} and not cache.freed


def test_blocks_given_to_a_newer_handoff_are_not_freed_for_an_older_one() -> None:
    cache, handoffs = Leases("prefill-0"), SentHandoffs()
    _sent(handoffs, cache, "old", [1, 2])
    cache.reassign_blocks([1, 2], "decode-0")  # claimed, decoded, freed by the decoder...
    del cache.owner[1], cache.owner[2]
    _sent(handoffs, cache, "new", [2, 3])  # ...and block 2 handed out again, here
    assert not handoffs.free_one("old", cache)
    assert cache.owner == {2: "prefill-0", 3: "prefill-0"}
    assert handoffs.free_one("new", cache) and cache.freed == [[2, 3]]


def test_a_handoff_this_instance_decodes_itself_is_never_freed_by_a_cancel() -> None:
    cache, handoffs = Leases("prefill-0"), SentHandoffs()
    _sent(handoffs, cache, "mine", [1, 2])
    handoffs.forget("mine")  # a hybrid instance took its own handoff for decoding
    assert not handoffs.free_one("mine", cache)
    _sent(handoffs, cache, "sent", [3, 4])
    # blocks 3-4 freed by their decoder, then taken by one of this instance's own
    # sequences (a swap-out): held locally, so left alone
    assert not handoffs.free_one("sent", cache, in_use={4, 9})
    assert not cache.freed and cache.owner == dict.fromkeys([1, 2, 3, 4], "prefill-0")
