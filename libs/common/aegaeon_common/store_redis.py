"""The :class:`~aegaeon_common.store.Store` contract on Redis (``redis`` client, asyncio).

Keys are ``NAMESPACE:key``; TTLs are Redis expiries (``PX``), so liveness is
judged by one clock, the server's, whatever the nodes' clocks say. A
transaction is Redis's optimistic ``WATCH`` / ``MULTI`` / ``EXEC``: the watched
keys are read, ``fn`` decides, and ``EXEC`` applies the writes only if no
other client wrote a watched key in between (``WatchError``: read again and
decide again). Every Redis failure surfaces as :class:`StoreError`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from aegaeon_common.store import DEFAULT_RETRIES, StoreConflictError, StoreError, TransactFn

T = TypeVar("T")
SOCKET_TIMEOUT_S = 2.0
BACKOFF_S = 0.001  # after a conflict: up to this x the attempt, at random


def _ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, not {ttl_s}")
    return max(1, int(ttl_s * 1000))


def _as_bytes(values: list[bytes | str | None]) -> list[bytes | None]:
    """MGET's values (bytes: the client never decodes responses here)."""
    return [v.encode() if isinstance(v, str) else v for v in values]


async def _checked(call: Awaitable[T]) -> T:
    """``call``'s result, a Redis failure raised as :class:`StoreError`."""
    try:
        return await call
    except RedisError as exc:
        raise StoreError(f"redis: {exc}") from None


class RedisStore:
    """A store in Redis at ``url`` (``redis://[:password@]host:port/db``)."""

    def __init__(self, url: str, namespace: str, password_file: Path | None = None) -> None:
        self.url = url
        self.namespace = namespace
        password = password_file.read_text().strip() if password_file is not None else None
        kwargs: dict[str, object] = {
            "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_connect_timeout": SOCKET_TIMEOUT_S,
            "health_check_interval": 10,
        }
        if password:
            kwargs["password"] = password
        self._redis = aioredis.Redis.from_url(url, **kwargs)  # type: ignore[arg-type]
        self.num_commits = 0
        self.num_conflicts = 0

    def _k(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def __repr__(self) -> str:  # the URL may hold a password
        return f"RedisStore(namespace={self.namespace!r})"

    async def start(self) -> None:
        try:
            await self._redis.ping()
        except RedisError as exc:
            raise StoreError(f"redis is not reachable: {exc}") from None

    async def close(self) -> None:
        await self._redis.aclose()

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        px = None if ttl_s is None else _ms(ttl_s)
        await _checked(self._redis.set(self._k(key), value, px=px))

    async def put_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool:
        return bool(await _checked(self._redis.set(self._k(key), value, px=_ms(ttl_s), nx=True)))

    async def get(self, key: str) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return _as_bytes(await _checked(self._redis.mget([self._k(k) for k in keys])))

    async def delete(self, *keys: str) -> None:
        if keys:
            await _checked(self._redis.delete(*(self._k(k) for k in keys)))

    async def set_add(self, name: str, *members: str) -> int:
        if not members:
            return 0
        return int(await _checked(self._redis.sadd(self._k(name), *members)))

    async def set_remove(self, name: str, *members: str) -> None:
        if members:
            await _checked(self._redis.srem(self._k(name), *members))

    async def set_members(self, name: str) -> set[str]:
        raw = await _checked(self._redis.smembers(self._k(name)))
        return {m.decode() if isinstance(m, bytes) else str(m) for m in raw}

    async def transact(
        self,
        keys: Sequence[str],
        fn: TransactFn[T],
        *,
        ttl_s: float | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> T:
        full = [self._k(k) for k in keys]
        px = None if ttl_s is None else _ms(ttl_s)
        # Not redis.asyncio's Redis.transaction(): it retries a conflict forever with
        # a fixed delay taken while still watching; the contract bounds the retries
        # (StoreConflictError), counts conflicts, and backs off at random outside the
        # watch so that two writers in step stop meeting.
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for attempt in range(retries):
                    try:
                        if full:
                            await pipe.watch(*full)
                            values = _as_bytes(await pipe.mget(full))
                        else:
                            values = []
                        writes, result = fn(values)
                        pipe.multi()  # type: ignore[no-untyped-call]
                        for key, value in writes.items():
                            if value is None:
                                pipe.delete(self._k(key))
                            else:
                                pipe.set(self._k(key), value, px=px)
                        await pipe.execute()
                    except WatchError:
                        self.num_conflicts += 1
                        # back off a random while so that two writers that keep
                        # meeting (one event loop each, in step) stop meeting
                        await asyncio.sleep(random.uniform(0, BACKOFF_S * (attempt + 1)))
                        continue
                    finally:
                        await pipe.reset()  # type: ignore[no-untyped-call]
                    self.num_commits += 1
                    return result
        except RedisError as exc:
            raise StoreError(f"redis: {exc}") from None
        raise StoreConflictError(f"{retries} conflicting writers in a row on {len(keys)} keys")
