"""An instance's entry in the shared registry (many nodes, ``store.kind: redis``).

Once ready, an instance writes its :class:`~aegaeon_common.registry.InstanceRecord`
(who and where it is, the models it serves with their KV room, its fitted
latency profile) with its load, every heartbeat, with a TTL of
``store.heartbeat_ttl``: a node that dies simply stops writing, and every proxy
replica drops it from dispatch once the key has expired. A drain marks the
record ``draining`` (no new work); a clean exit deletes it.

Its id goes into the ``instances`` index every beat too: a store that lost it
(restarted empty) or a replica that tidied it away (the record had expired: the
store or this process was stopped a while) lists it again at the next beat.
Listed again, it reads the store's epoch: a new one means the store lost its
contents, and the instance merges its own queues back
(:mod:`aegaeon_runtime.shared_queues`); the same one means only its record had
expired, and the replicas already ended or re-dispatched what it held.
"""

from __future__ import annotations

import time

import msgspec
from aegaeon_common.config import Config
from aegaeon_common.http_side import with_http_urls
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.registry import (
    INSTANCES,
    PROXIES,
    StoreEpoch,
    encode,
    instance_id,
    instance_key,
    load_of,
    record_of,
)
from aegaeon_common.store import Store, StoreError

from aegaeon_runtime.shared_queues import QueueSnapshots, SharedQueues

log = get_logger("registrar")
WARN_EVERY_S = 5.0


class Registrar:
    """Writes one instance's record; never raises for a store that is down (it logs
    and tries again next beat: the proxies see it gone meanwhile, as they should)."""

    def __init__(self, config: Config, store: Store, hello: InstanceHello, http_url: str,
                 snapshots: QueueSnapshots | None = None) -> None:  # fmt: skip
        self.store = store
        self.ttl_s = config.store.heartbeat_ttl_s
        self.instance_id = instance_id(config.node.name, hello.kind, hello.index)
        self.record = record_of(config, hello, self.instance_id, http_url)
        self._run_dir = config.run_dir
        self.epoch = StoreEpoch(store)
        # its queues in the store, rebuilt from the compute thread's snapshots after a loss
        self.queues = SharedQueues(store, self.instance_id, hello.incarnation,
                                   config.scheduler.max_group_size,
                                   snapshots or QueueSnapshots())  # fmt: skip
        self._listed = False
        self._check_epoch = False  # listed again: read the epoch (until that read succeeds)
        self.draining = False  # set on SIGTERM: the record says so until the exit
        self._warned_at = 0.0

    def serve(self, hello: InstanceHello) -> None:
        """The models it serves changed (``AddModel``): the record lists them, with the
        latency profile over them, from the next beat on."""
        self.record = msgspec.structs.replace(
            self.record, capacity_tokens=dict(hello.capacity_tokens), latency=hello.latency
        )

    async def beat(self, stats: InstanceStats) -> None:
        self.record = with_http_urls(self.record, self._run_dir)
        record = msgspec.structs.replace(self.record, load=load_of(stats), draining=self.draining)
        try:
            await self.store.put(instance_key(self.instance_id), encode(record), self.ttl_s)
            added = await self.store.set_add(INSTANCES, self.instance_id)
            if not self._listed:
                await self.epoch.check()  # (the epoch it registered in)
                self._listed = True
                log.info("registered", instance=self.instance_id, address=record.address)
            elif added:
                self._check_epoch = True
                log.warning("registered_again", instance=self.instance_id,
                            why="the store lost its index or its record had expired")  # fmt: skip
            if self._check_epoch:
                if await self.epoch.check():
                    log.warning("store_lost", instance=self.instance_id,
                                action="merging its queues back")  # fmt: skip
                    self.queues.lost()
                self._check_epoch = False
            await self.queues.step()
        except StoreError as exc:
            now = time.monotonic()
            if now - self._warned_at > WARN_EVERY_S:
                self._warned_at = now
                log.warning("registry_unreachable", instance=self.instance_id, error=str(exc))

    async def no_replica(self) -> bool:
        """Whether no proxy replica is listed (each takes itself off the list as it
        leaves, as at a whole cluster's stop, proxies first): nothing more can come to a
        draining instance. False while the store does not answer."""
        try:
            return not await self.store.set_members(PROXIES)
        except StoreError:
            return False

    async def deregister(self) -> None:
        try:
            await self.store.delete(instance_key(self.instance_id))
            await self.store.set_remove(INSTANCES, self.instance_id)
            log.info("deregistered", instance=self.instance_id)
        except StoreError as exc:
            log.warning("deregister_failed", instance=self.instance_id, error=str(exc))
