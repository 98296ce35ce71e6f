"""The workers' side of the cachemgr: typed calls, and the shared memory they map.

:class:`CacheClient` is async (a worker's event loop); :class:`SyncCacheClient`
wraps it for the worker's compute thread, which never runs on the loop.

Mappings: the KV region and the event table are attached read-write at
:meth:`CacheClient.register`; model regions read-only (writes fault) at
:meth:`CacheClient.load_model`, cached per model while this client pins it.
Nothing is ever unmapped under a live tensor (see ``aegaeon_gpumem.shm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol, TypeVar

import zmq.asyncio
from aegaeon_common.messages.cache import (
    REPLIES,
    AllocBlocks,
    BlocksAllocated,
    BlocksFreed,
    BlocksReassigned,
    CacheStats,
    FreeBlocks,
    GetStats,
    LoadModel,
    ModelLoaded,
    ModelUnpinned,
    ReassignBlocks,
    RegisterWorker,
    UnpinModel,
    UnregisterWorker,
    WorkerRegistered,
    WorkerUnregistered,
)
from aegaeon_common.messages.structs import EventSpec, KVShapeSpec
from aegaeon_common.transport import RemoteError, RpcClient
from aegaeon_common.wire import Message
from aegaeon_gpumem import EventHandle, EventTable, ShmRegion

from aegaeon_cachemgr.mapped import MappedModel, Registration

R = TypeVar("R", bound=Message)
T = TypeVar("T")


class ShapeLike(Protocol):
    """``KVShapeSpec`` or the engine's ``KVShape``."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def dtype(self) -> str: ...


EventLike = EventSpec | EventHandle | Mapping[str, Any]


def to_shape(shape: ShapeLike) -> KVShapeSpec:
    if isinstance(shape, KVShapeSpec):
        return shape
    return KVShapeSpec(
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        shape.block_size,
        str(shape.dtype).removeprefix("torch."),
    )


def to_event(event: EventLike) -> EventSpec:
    """An event in its message form (from a gpumem ``EventHandle`` or its dict form)."""
    if isinstance(event, EventSpec):
        return event
    handle = event if isinstance(event, EventHandle) else EventHandle.from_dict(event)
    return EventSpec(
        handle.kind, handle.table, handle.slot, handle.value, handle.handle, handle.device
    )


class CacheClient:
    """One worker's connection to the cachemgr (async; use from the worker's event loop).

    ``worker_id`` owns the blocks this client allocates and the models it pins;
    the cachemgr reclaims them when this process dies.
    """

    def __init__(
        self,
        address: str,
        worker_id: str,
        ctx: zmq.asyncio.Context | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.address = address
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self._rpc = RpcClient(self._ctx, address, REPLIES)
        self.registration: Registration | None = None
        self._models: dict[str, MappedModel] = {}
        self._pins: dict[str, int] = {}

    async def _call(
        self, request: Message, reply_type: type[R], timeout_s: float | None = None
    ) -> R:
        reply = await self._rpc.call(request, timeout_s or self.timeout_s)
        if not isinstance(reply, reply_type):
            raise TypeError(f"{request.TAG}: expected {reply_type.TAG}, got {reply.TAG}")
        return reply

    async def register(self, pid: int | None = None, num_event_slots: int = 0) -> Registration:
        """Start this worker's lease; attach the KV region and the event table.

        A second call (e.g. after the cachemgr restarted) starts a new lease:
        the old one's blocks and pins are gone.
        """
        reply = await self._call(
            RegisterWorker(self.worker_id, os.getpid() if pid is None else pid, num_event_slots),
            WorkerRegistered,
        )
        self._detach()
        self.registration = Registration(
            worker_id=self.worker_id,
            kv_region=ShmRegion.attach(reply.kv_region),
            event_table=EventTable.attach(reply.event_table),
            event_slots=tuple(reply.event_slots),
            slab_bytes=reply.slab_bytes,
        )
        return self.registration

    async def load_model(self, name: str, pin: bool = True) -> MappedModel:
        """The model's region mapped read-only, with its manifest (loads it if needed)."""
        reply = await self._call(LoadModel(name, pin, self.worker_id if pin else ""), ModelLoaded)
        cached = self._models.get(name)
        if cached is None or cached.region.name != reply.region:
            cached = MappedModel.attach(reply)
            self._models[name] = cached
        if pin:
            self._pins[name] = self._pins.get(name, 0) + 1
        return cached.with_reply(reply)

    async def unpin(self, name: str) -> int:
        """Drop one of this worker's pins; the mapping is dropped with the last one
        (tensors made from it stay valid). Returns the model's remaining pins."""
        reply = await self._call(UnpinModel(name, self.worker_id), ModelUnpinned)
        left = self._pins.get(name, 0) - 1
        if left > 0:
            self._pins[name] = left
        else:
            self._pins.pop(name, None)
            cached = self._models.pop(name, None)
            if cached is not None:
                cached.region.close()
        return reply.pins

    async def alloc_blocks(self, shape: ShapeLike, num_blocks: int) -> BlocksAllocated:
        """``num_blocks`` KV blocks of ``shape`` leased to this worker (offsets into the
        KV region, multiples of ``block_bytes``); RemoteError ``out_of_blocks`` if full."""
        return await self._call(
            AllocBlocks(self.worker_id, to_shape(shape), num_blocks), BlocksAllocated
        )

    async def free_blocks(self, offsets: list[int], event: EventLike | None = None) -> BlocksFreed:
        """Free blocks; with ``event`` (the last copy touching them) they are not
        reallocated before it completes."""
        ref = None if event is None else to_event(event)
        return await self._call(FreeBlocks(self.worker_id, list(offsets), ref), BlocksFreed)

    async def reassign_blocks(
        self, offsets: list[int], new_owner: str, owner: str | None = None
    ) -> int:
        """Move blocks' lease to ``new_owner`` (``owner`` checks the current holder;
        default this worker, ``""`` to skip the check)."""
        held_by = self.worker_id if owner is None else owner
        reply = await self._call(
            ReassignBlocks(list(offsets), new_owner, held_by), BlocksReassigned
        )
        return reply.num_blocks

    async def stats(self) -> CacheStats:
        return await self._call(GetStats(), CacheStats)

    async def unregister(self, timeout_s: float = 2.0) -> None:
        """End the lease now (blocks freed, pins dropped)."""
        if self.registration is not None:
            await self._call(UnregisterWorker(self.worker_id), WorkerUnregistered, timeout_s)
            self.registration = None

    async def close(self, unregister: bool = True) -> None:
        """End the lease (best effort: the cachemgr may be gone) and detach everything."""
        if unregister and self.registration is not None:
            with contextlib.suppress(RemoteError, TimeoutError):
                await self.unregister()
        self._detach()
        self._rpc.close()
        if self._own_ctx:
            self._ctx.term()

    def _detach(self) -> None:
        for model in self._models.values():
            model.region.close()
        self._models.clear()
        self._pins.clear()
        if self.registration is not None:
            self.registration.close()
            self.registration = None


class SyncCacheClient:
    """Blocking facade over a :class:`CacheClient` for threads other than its loop's
    (thread-safe: each call is scheduled on the loop)."""

    def __init__(
        self, client: CacheClient, loop: asyncio.AbstractEventLoop, timeout_s: float | None = None
    ) -> None:
        self.client = client
        self._loop = loop
        self._timeout_s = timeout_s or client.timeout_s + 5.0

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_running() and _on_loop(self._loop):
            coro.close()
            raise RuntimeError("SyncCacheClient called on its own event loop (would deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

    def load_model(self, name: str, pin: bool = True) -> MappedModel:
        return self._run(self.client.load_model(name, pin))

    def unpin(self, name: str) -> int:
        return self._run(self.client.unpin(name))

    def alloc_blocks(self, shape: ShapeLike, num_blocks: int) -> BlocksAllocated:
        return self._run(self.client.alloc_blocks(shape, num_blocks))

    def free_blocks(self, offsets: list[int], event: EventLike | None = None) -> BlocksFreed:
        return self._run(self.client.free_blocks(offsets, event))

    def reassign_blocks(self, offsets: list[int], new_owner: str, owner: str | None = None) -> int:
        return self._run(self.client.reassign_blocks(offsets, new_owner, owner))

    def stats(self) -> CacheStats:
        return self._run(self.client.stats())


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
