"""The Store contract, on the in-process store and on a real redis-server alike."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
from aegaeon_common.store import MemoryStore, Store, StoreConflictError, StoreError
from aegaeon_common.store_redis import RedisStore

_namespaces = itertools.count()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    url = request.getfixturevalue("redis_url")
    made = RedisStore(url, namespace=f"t{next(_namespaces)}")
    await made.start()
    yield made
    await made.close()


async def test_put_get_delete_and_ttl(store: Store) -> None:
    await store.put("a", b"1")
    await store.put("b", b"2", ttl_s=0.2)
    assert await store.get_many(["a", "b", "c"]) == [b"1", b"2", None]
    assert not await store.put_if_absent("a", b"x", ttl_s=1)
    assert await store.put_if_absent("lease", b"me", ttl_s=0.2)
    assert not await store.put_if_absent("lease", b"you", ttl_s=0.2)
    await asyncio.sleep(0.35)
    assert await store.get("b") is None  # expired: its writer stopped
    assert await store.put_if_absent("lease", b"you", ttl_s=1)  # the lease lapsed
    await store.delete("a", "nothing")
    assert await store.get("a") is None


async def test_sets(store: Store) -> None:
    assert await store.set_add("s", "x", "y") == 2
    assert await store.set_add("s", "y", "z") == 1  # (y was there: a writer knows it was listed)
    await store.set_remove("s", "x")
    assert await store.set_members("s") == {"y", "z"}
    assert await store.set_members("empty") == set()


async def test_transaction_reads_decides_and_writes(store: Store) -> None:
    await store.put("n", b"1")

    def bump(values: list[bytes | None]) -> tuple[dict[str, bytes | None], int]:
        n = int(values[0] or b"0") + 1
        return {"n": str(n).encode(), "gone": None}, n

    assert await store.transact(["n"], bump) == 2
    assert await store.get("n") == b"2"

    def refuse(values: list[bytes | None]) -> tuple[dict[str, bytes | None], int]:
        raise LookupError("no instance")

    with pytest.raises(LookupError):
        await store.transact(["n"], refuse)
    assert await store.get("n") == b"2"  # nothing written


async def test_concurrent_transactions_never_lose_an_update(redis_url: str) -> None:
    """Two clients (two proxy replicas) bump one counter 50 times each, interleaved:
    WATCH/MULTI makes every read-decide-write serial, so none is lost."""
    a, b = RedisStore(redis_url, "race"), RedisStore(redis_url, "race")
    await a.put("n", b"0")

    def bump(values: list[bytes | None]) -> tuple[dict[str, bytes | None], None]:
        return {"n": str(int(values[0] or b"0") + 1).encode()}, None

    async def many(s: RedisStore) -> None:
        for _ in range(50):
            await s.transact(["n"], bump)

    await asyncio.gather(many(a), many(b))
    assert await a.get("n") == b"100"
    assert a.num_commits + b.num_commits == 100
    await a.delete("n")
    await a.close()
    await b.close()


async def test_a_transaction_that_always_conflicts_gives_up(redis_url: str) -> None:
    import redis

    s = RedisStore(redis_url, "conflict")
    other = redis.Redis.from_url(redis_url)
    writes = itertools.count()

    def meddle(values: list[bytes | None]) -> tuple[dict[str, bytes | None], None]:
        # another client writes the watched key between the read and EXEC, every time
        other.set("conflict:k", str(next(writes)))
        return {"k": b"mine"}, None

    with pytest.raises(StoreConflictError):
        await s.transact(["k"], meddle, retries=3)
    assert s.num_conflicts == 3 and s.num_commits == 0
    assert await s.get("k") == b"2"  # the other writer's last value: ours never landed
    other.close()
    await s.close()


async def test_an_unreachable_redis_is_a_store_error() -> None:
    s = RedisStore("redis://127.0.0.1:1/0", "x")
    with pytest.raises(StoreError, match="not reachable"):
        await s.start()
    with pytest.raises(StoreError):
        await s.put("k", b"v")
    await s.close()


async def test_memory_store_ttl_follows_its_clock() -> None:
    now = [0.0]
    s = MemoryStore(clock=lambda: now[0])
    await s.put("k", b"v", ttl_s=3)
    now[0] = 2.9
    assert await s.get("k") == b"v"
    now[0] = 3.0
    assert await s.get("k") is None
    with pytest.raises(ValueError):
        await s.put("k", b"v", ttl_s=0)
