"""The deployment's shared state: one small key-value interface, two stores.

What the proxy layer and the nodes share (the instance registry and loads, the
dispatchers' queue state, request metadata, proxy liveness) goes through a
:class:`Store`. :class:`MemoryStore` keeps it in the process (the embedded
default: one proxy, nothing to share with); ``aegaeon_common.store_redis``'s
``RedisStore`` keeps it in Redis, for a replicated proxy layer over many nodes.
Both honour the same contract, and the tests run one suite against both.

Contract (keys are strings, values bytes; a store prefixes every key with its
namespace, so deployments may share one Redis):

* ``put(key, value, ttl_s)``: set; with ``ttl_s`` the key vanishes that many
  seconds after its last put (the heartbeat rule: a writer that stops is gone).
* ``put_if_absent`` (a lease: True when this caller took it), ``get_many``,
  ``delete``; sets of strings (``set_add``, ``set_remove``, ``set_members``)
  index keys that expire, since listing a namespace is not part of the contract.
  ``set_add`` returns how many of its members were not in the set (a writer that
  adds itself every beat learns when the index lost it).
* ``transact(keys, fn)``: optimistic concurrency. ``fn`` gets the current
  values of ``keys`` and returns ``(writes, result)``; the writes (``None``
  deletes) commit atomically only if none of ``keys`` changed since they were
  read, else ``fn`` runs again on fresh values (up to ``retries`` times, then
  :class:`StoreConflictError`). ``fn`` must be pure: it may run several times.
  An exception from ``fn`` aborts with nothing written.

Every store failure (unreachable, timed out) is a :class:`StoreError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")

Writes = Mapping[str, bytes | None]
TransactFn = Callable[[list[bytes | None]], tuple[Writes, T]]
DEFAULT_RETRIES = 32


class StoreError(RuntimeError):
    """The store cannot be reached or refused an operation."""


class StoreConflictError(StoreError):
    """A transaction lost to concurrent writers ``retries`` times in a row."""


class Store(Protocol):
    """See the module docstring for the contract."""

    #: transactions committed and retried since start (dispatch contention)
    num_commits: int
    num_conflicts: int

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None: ...
    async def put_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool: ...
    async def get(self, key: str) -> bytes | None: ...
    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...
    async def delete(self, *keys: str) -> None: ...
    async def set_add(self, name: str, *members: str) -> int: ...
    async def set_remove(self, name: str, *members: str) -> None: ...
    async def set_members(self, name: str) -> set[str]: ...
    async def transact(
        self,
        keys: Sequence[str],
        fn: TransactFn[T],
        *,
        ttl_s: float | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> T: ...


class MemoryStore:
    """The store of one process (the embedded default).

    Every method completes without awaiting anything, so on one event loop a
    transaction's read, ``fn`` and writes are atomic by construction; nothing
    conflicts. TTLs run on the monotonic clock (``clock`` for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._values: dict[str, tuple[bytes, float | None]] = {}
        self._sets: dict[str, set[str]] = {}
        self.num_commits = 0
        self.num_conflicts = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _live(self, key: str) -> bytes | None:
        item = self._values.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and self._clock() >= expires:
            del self._values[key]
            return None
        return value

    def _put(self, key: str, value: bytes, ttl_s: float | None) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, not {ttl_s}")
        expires = None if ttl_s is None else self._clock() + ttl_s
        self._values[key] = (bytes(value), expires)

    async def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self._put(key, value, ttl_s)

    async def put_if_absent(self, key: str, value: bytes, ttl_s: float) -> bool:
        if self._live(key) is not None:
            return False
        self._put(key, value, ttl_s)
        return True

    async def get(self, key: str) -> bytes | None:
        return self._live(key)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._live(k) for k in keys]

    async def delete(self, *keys: str) -> None:
        for key in keys:  # a value or a set, as in Redis (one key space)
            self._values.pop(key, None)
            self._sets.pop(key, None)

    async def set_add(self, name: str, *members: str) -> int:
        members_now = self._sets.setdefault(name, set())
        added = len(set(members) - members_now)
        members_now.update(members)
        return added

    async def set_remove(self, name: str, *members: str) -> None:
        members_now = self._sets.get(name)
        if members_now is not None:
            members_now.difference_update(members)
            if not members_now:
                del self._sets[name]

    async def set_members(self, name: str) -> set[str]:
        return set(self._sets.get(name, ()))

    async def transact(
        self,
        keys: Sequence[str],
        fn: TransactFn[T],
        *,
        ttl_s: float | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> T:
        writes, result = fn([self._live(k) for k in keys])
        for key, value in writes.items():
            if value is None:
                self._values.pop(key, None)
            else:
                self._put(key, value, ttl_s)
        self.num_commits += 1
        return result
