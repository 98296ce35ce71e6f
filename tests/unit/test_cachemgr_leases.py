"""Block leases of the unified KV cache under random alloc/free/reassign/reclaim sequences."""

from __future__ import annotations

from aegaeon_cachemgr.errors import CacheError
from aegaeon_cachemgr.kv_cache import UnifiedKVCache
from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_gpumem import EventTable, ShmRegion, Timeline, unique_name
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPES = [
    KVShapeSpec(2, 2, 16, 16, "bfloat16"),  # 4 KiB blocks
    KVShapeSpec(3, 1, 32, 16, "float32"),  # 12 KiB blocks: not a power of two
    KVShapeSpec(1, 4, 64, 8, "float16"),  # 8 KiB blocks
]
OWNERS = ["prefill-0", "decode-0", "decode-1"]

op = st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from(OWNERS), st.integers(0, 2), st.integers(1, 40)),
    st.tuples(st.just("free"), st.sampled_from(OWNERS), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("reassign"), st.sampled_from(OWNERS), st.sampled_from(OWNERS)),
    st.tuples(st.just("release"), st.sampled_from(OWNERS)),
    st.tuples(
        st.just("signal"),
    ),
)


def check(kv: UnifiedKVCache, leased: dict[int, str]) -> None:
    stats = kv.stats()
    per_owner: dict[str, int] = {}
    for owner in leased.values():
        per_owner[owner] = per_owner.get(owner, 0) + 1
    assert stats.blocks_per_owner == per_owner
    # Live blocks in the pool = leased + waiting in the move list (one locked snapshot).
    assert sum(s.used_blocks for s in stats.shapes) == len(leased) + stats.move_list_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=1, max_size=40))
def test_leases_stay_consistent(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    region = ShmRegion.create(unique_name("test-kv"), 1 << 20)
    table = EventTable.create(unique_name("test-ev"), 4)
    kv = UnifiedKVCache(region, 64 << 10, table.name)
    timeline = Timeline(table, 0)
    leased: dict[int, str] = {}
    try:
        for step in ops:
            if step[0] == "alloc":
                _, owner, shape, n = step
                try:
                    offsets, block_bytes = kv.alloc(owner, SHAPES[shape], n)
                except CacheError as exc:
                    assert exc.code == "out_of_blocks"
                    continue
                assert all(o % block_bytes == 0 and o not in leased for o in offsets)
                leased.update(dict.fromkeys(offsets, owner))
            elif step[0] == "free":
                _, owner, k, pending = step
                mine = [o for o, w in leased.items() if w == owner][: k + 1]
                if not mine:
                    continue
                event = EventSpec("cpu", table.name, 0, timeline.issue()) if pending else None
                kv.free(owner, mine, event)
                for o in mine:
                    del leased[o]
            elif step[0] == "reassign":
                _, owner, new_owner = step
                mine = [o for o, w in leased.items() if w == owner]
                if mine:
                    kv.reassign(mine, new_owner, owner)
                    leased.update(dict.fromkeys(mine, new_owner))
            elif step[0] == "release":
                assert kv.release_owner(step[1]) == sum(w == step[1] for w in leased.values())
                leased = {o: w for o, w in leased.items() if w != step[1]}
            else:
                timeline.signal(timeline.issue())
            check(kv, leased)
    finally:
        kv.close()
        table.close()
        region.close()


def test_a_free_by_the_old_owner_of_a_reassigned_handoff_is_refused_whole() -> None:
    # A prefill instance frees the handoffs it sent that nobody claimed (a new proxy
    # started): one the proxy moved to a decode instance must stay that instance's.
    region = ShmRegion.create(unique_name("test-kv"), 1 << 20)
    table = EventTable.create(unique_name("test-ev"), 4)
    kv = UnifiedKVCache(region, 64 << 10, table.name)
    try:
        claimed, _ = kv.alloc("prefill-0", SHAPES[0], 3)
        unclaimed, _ = kv.alloc("prefill-0", SHAPES[0], 2)
        kv.reassign(claimed, "decode-0", "prefill-0")
        for offsets in (claimed, claimed[:1] + unclaimed):  # wholly or partly moved
            try:
                kv.free("prefill-0", offsets, None)
            except CacheError as exc:
                assert exc.code == "not_owner"
            else:
                raise AssertionError("a free of another owner's blocks went through")
        assert kv.stats().blocks_per_owner == {"decode-0": 3, "prefill-0": 2}
        assert kv.free("prefill-0", unclaimed, None) == (2, 0)
        assert kv.stats().blocks_per_owner == {"decode-0": 3}
    finally:
        kv.close()
        table.close()
        region.close()
