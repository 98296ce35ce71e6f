"""Prefill/decode role switching over the store (one node's proxy, or its replicas).

One proxy decides (:mod:`aegaeon_proxy.cluster.roles`'s
:class:`~aegaeon_proxy.cluster.roles.RoleSwitcher`; on one node, the node's): the one
holding the roles lease (:data:`~aegaeon_common.registry.ROLES_LEASE`, a key with
a TTL it renews at every registry refresh; once it stops, another takes the lease
:data:`LEASE_S` later). It reads the shared state where one node's proxy reads its
own:

* **arrival velocity**: every replica's prompt tokens/s, each published in its
  :class:`~aegaeon_common.registry.ProxyRecord`, summed;
* **backlog**: prompt tokens waiting in every prefill queue of the store;
* **prefill velocity** and **busy share**: each instance's registry record
  (``load.prefill_tokens`` / ``load.prefill_s``), as its heartbeat;
* **decode demand**: Eq. 3's ``S`` of every work list of the store.

It writes the roles as one :class:`~aegaeon_common.registry.RolesRecord`; every
replica reads that with its registry refresh and dispatches by it
(:attr:`RegistryView.roles <aegaeon_proxy.cluster.registry.RegistryView.roles>`):
new prefill work goes to the instances in the prefill role, and those are
placed on for decode only while no decode-role instance of the node keeps up
(``reserved``), as on one node. A role change moves no request and no KV. The
roles hold still while any instance drains; one that joins starts in its
configured role. A store that restarts empty loses the lease and the record:
the first replica to refresh takes the lease and writes the roles again; the
others keep the roles they read last until then.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.registry import (
    PROXIES,
    ROLES,
    ROLES_LEASE,
    InstanceRecord,
    ProxyRecord,
    RolesRecord,
    decode_roles,
    encode,
    proxy_key,
)
from aegaeon_common.store import Store
from aegaeon_sched import LatencyModel, cluster_velocity
from aegaeon_sched.shared import decode_demands, prefill_backlog

from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.roles import RoleSwitcher, base_role, record_meter

log = get_logger("cluster")

__all__ = ["LEASE_S", "ReplicaRoles"]

LEASE_S = 3.0  # the roles lease: a decider that stops is replaced this much later
BEAT_EVERY_S = 1.0  # an instance's busy share is measured over at least this
SHARED_CHANGES = 16  # the decider's last changes, in the record (every replica's stats)


class ReplicaRoles:
    """A replica's part in the roles of many nodes (see the module). ``refresh`` after
    each registry refresh; ``arrived`` for each request this replica accepts."""

    def __init__(self, config: Config, store: Store, view: RegistryView, proxy_id: str) -> None:
        self.config = config
        self.store = store
        self.view = view
        self.proxy_id = proxy_id
        self.enabled = config.role_switching
        self.switcher = RoleSwitcher(config, {}, self.enabled)
        self.deciding = False
        self.decider = ""  # the replica whose roles these are
        self.shared_changes: list[dict[str, Any]] = []  # the decider's last changes
        self._written: dict[str, str] | None = None
        self._followed = RolesRecord(v=1)  # the decider's record read last
        self._fed: dict[tuple[str, int], float] = {}  # instance -> when its busy share was fed

    def arrived(self, now_s: float, prompt_tokens: int) -> None:
        self.switcher.arrived(now_s, prompt_tokens)

    def arrival_rate(self, now_s: float) -> float:
        """Prompt tokens/s arriving at this replica (its heartbeat publishes it)."""
        return self.switcher.arrivals.rate(now_s)

    async def refresh(self) -> None:
        """Take or renew the lease; decide (the holder) or follow the record. Raises
        ``StoreError``."""
        if not self.enabled:
            return
        records = list(self.view.live.values())
        base = {r.instance_id: base_role(r.kind) for r in records}
        self.deciding = await self._hold_lease()
        if not self.deciding:
            raw = await self.store.get(ROLES)
            # (none: no decision yet, or the store lost it and the decider writes it again)
            record = decode_roles(raw) if raw is not None else self._followed
            self._followed = record
            self.switcher.controller.track(base, record.roles)
            self.decider, self.shared_changes = record.proxy, list(record.changes)
            self._written = None  # (a replica that takes the lease over writes at once)
        else:
            self.switcher.controller.track(base)
            await self._decide(records)
            self.decider = self.proxy_id
        self.view.roles = self.switcher.roles

    async def _hold_lease(self) -> bool:
        me = self.proxy_id.encode()

        def claim(values: list[bytes | None]) -> tuple[dict[str, bytes | None], bool]:
            holder = values[0]
            return ({ROLES_LEASE: me}, True) if holder in (None, me) else ({}, False)

        return await self.store.transact([ROLES_LEASE], claim, ttl_s=LEASE_S)

    def store_lost(self) -> None:
        """The store restarted empty: the decider writes the roles again at its next
        refresh (the others keep following the roles they read last meanwhile)."""
        self._written = None

    async def leave(self) -> None:
        """A replica that stops gives the lease up (another decides at once, from the
        roles it wrote). Raises ``StoreError``."""
        me = self.proxy_id.encode()

        def release(values: list[bytes | None]) -> tuple[dict[str, bytes | None], None]:
            return ({ROLES_LEASE: None} if values[0] == me else {}), None

        await self.store.transact([ROLES_LEASE], release)
        self.deciding = False

    async def _decide(self, records: list[InstanceRecord]) -> None:
        now = time.monotonic()
        meters = [record_meter(r) for r in records]
        fed, self._fed = self._fed, {}  # (instances gone are forgotten)
        for meter in meters:  # (a record is rewritten every heartbeat, read every refresh)
            key = (meter.name, meter.incarnation)
            self._fed[key] = fed.get(key, -BEAT_EVERY_S)
            if now - self._fed[key] >= BEAT_EVERY_S:
                self.switcher.heartbeat(meter, now)
                self._fed[key] = now
        latency = self.view.latency()
        if latency is not None and records:
            backlog, demand = await self._shared_load(records, latency)
            arrivals = self.arrival_rate(now) + await self._others_arrivals()
            alive = not any(r.draining for r in records)
            self.switcher.decide(now, meters, backlog, demand, latency, alive,
                                 arrival_tokens_per_s=arrivals)  # fmt: skip
        roles = self.switcher.roles
        if roles != self._written:
            changes = self.switcher.changes[-SHARED_CHANGES:]
            await self.store.put(ROLES, encode(RolesRecord(v=1, roles=roles, proxy=self.proxy_id,
                                                           changes=changes)))  # fmt: skip
            self._written = dict(roles)
            self.shared_changes = list(changes)

    async def _shared_load(self, records: list[InstanceRecord], latency: LatencyModel
                           ) -> tuple[int, dict[str, float]]:  # fmt: skip
        """The backlog of every prefill queue and the decode demand of every work list."""
        # (with roles moving every instance may hold a prefill queue and a work list)
        keys = [RegistryView.queue_key(r, stage) for stage in ("prefill", "decode")
                for r in records]  # fmt: skip
        raws = await self.store.get_many(keys)
        states = [None if raw is None else msgspec.msgpack.decode(raw) for raw in raws]
        ids = [r.instance_id for r in records]
        queues = dict(zip(ids, states[: len(ids)], strict=True))
        lists = dict(zip(ids, states[len(ids) :], strict=True))
        backlog = prefill_backlog(queues, self.config.scheduler.max_group_size)
        demand = decode_demands(lists, capacity_tokens={r.instance_id: r.capacity_tokens
                                                        for r in records},
                                latency=latency, tbt_s=self.config.slo.tbt_s)  # fmt: skip
        return backlog, demand

    async def _others_arrivals(self) -> float:
        ids = sorted(await self.store.set_members(PROXIES) - {self.proxy_id})
        raws = await self.store.get_many([proxy_key(p) for p in ids])
        total = 0.0
        for raw in raws:
            if raw is not None:
                try:
                    total += msgspec.msgpack.decode(raw, type=ProxyRecord).arrival_tokens_per_s
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
        return total

    def snapshot(self, now_s: float) -> dict[str, object]:
        """For ``/v1/aegaeon/stats``: as one node's, with who decides; the changes are
        the decider's."""
        velocity = cluster_velocity(r.load.velocity for r in self.view.live.values())
        out = self.switcher.snapshot(now_s, velocity)
        out.update(decider=self.decider, deciding=self.deciding,
                   changes=list(self.shared_changes))  # fmt: skip
        return out

    def velocity(self) -> Mapping[str, Mapping[str, float]]:
        """Each instance's token velocity by stage (its registry record's)."""
        return {r.instance_id: r.load.velocity for r in self.view.live.values()}
