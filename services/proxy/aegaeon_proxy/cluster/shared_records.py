"""What the proxy replicas share that is not soft state: kept by every replica, whatever
the store loses.

Heartbeat records, queues and leases are rebuilt by their writers within a beat
of a store that restarted empty. The operator's changes at run time are not: a
model's settings (``PATCH``), the models added and removed (``servedmodels``),
and any record that joins them (:meth:`SharedRecords.follow`) exist nowhere
but in the store and in what each replica applied. So every replica keeps,
for each such key, the newest record it has seen or written, and at each
registry refresh

* **follows**: a record newer than the one it keeps is kept and applied (its
  family's ``apply``);
* **writes back** the one it keeps where the store has none (it lost it) or an
  older one (a replica that lagged wrote back what it knew), in a transaction
  that writes only over an absent or older record: replicas writing back at
  once agree, and none goes back to an older state;
* **publishes** a change on top of the newest record it knows, the store's or
  its own (after a loss, a change does not start from an empty record).

"Newest" is the greater stamp ``(version, proxy, bytes)``, the same on every
replica. Each write takes ``version = max(newest + 1, now in ms)``: a change
made after a loss outranks what a lagging replica writes back from before it,
and a replica whose clock lags still counts up. A replica that starts knows
nothing but its config: it writes nothing back and resurrects nothing, it
follows. Records carry ``version`` and ``proxy`` fields
(``aegaeon_common.registry``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.store import Store, StoreError

from aegaeon_proxy.backend import BackendError

log = get_logger("cluster")

__all__ = ["SharedRecords", "newer"]

Apply = Callable[[str, bytes], None]  # (key, record) -> applied here; may raise DecodeError
# (newest record known, new version) -> record (None: it changes nothing)
Build = Callable[[bytes | None, int], bytes | None]


class _Stamp(msgspec.Struct):
    version: int = 0
    proxy: str = ""


def _stamp(raw: bytes) -> tuple[int, str, bytes]:
    try:
        stamp = msgspec.msgpack.decode(raw, type=_Stamp)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return -1, "", raw  # a record nobody can read ranks below every other
    return stamp.version, stamp.proxy, raw


def newer(a: bytes | None, b: bytes | None) -> bool:
    """``a`` is a newer record than ``b`` (None: no record)."""
    if a is None:
        return False
    return b is None or _stamp(a) > _stamp(b)


class SharedRecords:
    """One replica's part (see the module); ``clock`` (wall, seconds) for tests."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock
        # (prefix of its keys, the keys to read now, apply) of each family followed
        self._families: list[tuple[str, Callable[[], Iterable[str]], Apply]] = []
        self.kept: dict[str, bytes] = {}  # key -> the newest record seen or written here
        self.num_written_back = 0

    def follow(self, prefix: str, keys: Callable[[], Iterable[str]], apply: Apply) -> None:
        """Keep the records under ``prefix``: ``keys()`` (read at each refresh, with those
        kept already), applied by ``apply`` when newer. Families refresh in this order."""
        self._families.append((prefix, keys, apply))

    async def refresh(self) -> None:
        """Follow and write back (see the module), one read per family. Raises
        ``StoreError``."""
        for prefix, keys_now, apply in self._families:
            keys = sorted({*keys_now(), *(k for k in self.kept if k.startswith(prefix))})
            raws = await self.store.get_many(keys)
            for key, raw in zip(keys, raws, strict=True):
                kept = self.kept.get(key)
                if raw is not None and newer(raw, kept):
                    self.kept[key] = raw
                    try:
                        apply(key, raw)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        log.warning("bad_shared_record", key=key, error=str(exc))
                elif kept is not None and newer(kept, raw):
                    await self._write_back(key, kept)

    async def _write_back(self, key: str, kept: bytes) -> None:
        def write(values: list[bytes | None]) -> tuple[dict[str, bytes | None], bool]:
            return ({key: kept}, True) if newer(kept, values[0]) else ({}, False)

        if await self.store.transact([key], write):
            self.num_written_back += 1
            log.warning("shared_record_written_back", key=key,
                        why="the store lost it or held an older one")  # fmt: skip

    async def publish(self, key: str, build: Build) -> bytes | None:
        """Write a change: ``build(newest record known, version)`` makes the record (None:
        nothing to write). Raises :class:`BackendError` (503 ``store_unavailable``) when
        the store fails or the newest record cannot be read."""

        def change(values: list[bytes | None]) -> tuple[dict[str, bytes | None], bytes | None]:
            stored, kept = values[0], self.kept.get(key)
            base = stored if newer(stored, kept) else kept
            floor = _stamp(base)[0] + 1 if base is not None else 1
            raw = build(base, max(floor, int(self._clock() * 1000)))
            return ({key: raw} if raw is not None else {}), raw

        try:
            raw = await self.store.transact([key], change)
        except (StoreError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BackendError.store_failed(exc) from None
        if raw is not None:
            self.kept[key] = raw
        return raw
