"""Prefill/decode role switching in the proxy: token velocity in, role changes out.

The policy (:mod:`aegaeon_sched.roles`) is pure; :class:`SharedRoles` is every
proxy's part, and its driver in the proxy holding the roles lease (a key with a TTL
it renews at every registry refresh). The decider meters the shared state as the
simulator does (:class:`aegaeon_sched.RoleMeter`) and writes the roles as one
:class:`~aegaeon_common.registry.RolesRecord`, which every proxy dispatches by
(:attr:`RegistryView.roles <aegaeon_proxy.cluster.registry.RegistryView.roles>`).
A change is carried out by dispatch alone: with ``roles.enabled`` every instance
runs the hybrid loop (decode instances take prefill work on the hybrid channel),
so no message tells an instance its role. An instance leaving the prefill role keeps its queued
prefills, which run to the end (standby); one joining it keeps its decode
batches: no request moves, no KV is handed anywhere new. The roles hold still
while any instance drains (its capacity is unknown); one that joins starts in
its configured role. A store that restarts empty loses the lease and the
record: the first proxy to refresh takes the lease and writes the roles again;
the others keep the roles they read last until then.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping

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
from aegaeon_common.wire import to_plain
from aegaeon_sched import (
    LatencyModel,
    RoleChange,
    RoleController,
    RoleMeter,
    RoleSettings,
    cluster_velocity,
)
from aegaeon_sched.roles import DECODE, PREFILL, estimated_prefill_velocity
from aegaeon_sched.shared import decode_demands, prefill_backlog, prefill_queue_of, work_list_of

from aegaeon_proxy.cluster.registry import RegistryView

log = get_logger("cluster")

__all__ = ["LEASE_S", "SharedRoles"]

MIN_MEASURED_S = 0.2  # prefill seconds before an instance's measured rate replaces the estimate
MAX_CHANGES = 64  # role changes kept for /v1/aegaeon/stats
LEASE_S = 3.0  # the roles lease: a decider that stops is replaced this much later
BEAT_EVERY_S = 1.0  # an instance's busy share is measured over at least this
SHARED_CHANGES = 16  # the decider's last changes, in the record (every proxy's stats)


class SharedRoles(RoleMeter):
    """See the module; ``arrived`` for each request this proxy accepts, ``refresh``
    after each registry refresh. Without ``roles.enabled`` it only keeps the velocities
    (metrics, stats)."""

    def __init__(self, config: Config, store: Store, view: RegistryView, proxy_id: str) -> None:
        super().__init__(beat_every_s=BEAT_EVERY_S, min_measured_s=MIN_MEASURED_S)
        self.config = config
        self.store = store
        self.view = view
        self.proxy_id = proxy_id
        self.enabled = config.role_switching
        r = config.roles
        settings = RoleSettings(
            high_util=r.high_util, low_util=r.low_util, up_hold_s=r.up_hold_s,
            down_hold_s=r.down_hold_s, min_dwell_s=r.min_dwell_s,
            backlog_horizon_s=r.backlog_horizon_s or config.slo.ttft_s / 2,
            decode_high=r.decode_high, convert_max_demand=r.convert_max_demand,
            min_prefill=r.min_prefill, min_decode=r.min_decode,
        )  # fmt: skip
        self.controller = RoleController({}, settings)
        self._estimates: dict[tuple[str, int], float] = {}  # (instance, incarnation) -> tok/s
        self.switches: Counter[str] = Counter()  # new role -> changes decided here
        self.changes: list[dict[str, object]] = []  # the last MAX_CHANGES decided here
        self.deciding = False
        # the roles in force: the decider's record (its proxy, its last changes), as this
        # replica read it last or wrote it (``_written``: else it writes at its next turn)
        self.record = RolesRecord(v=1)
        self._written = False

    @property
    def roles(self) -> dict[str, str]:
        return dict(self.controller.roles)

    def prefill_velocity(self, record: InstanceRecord, fallback: LatencyModel) -> float:
        """Prompt tokens/s while busy: measured, else estimated."""
        load = record.load
        measured = self.measured(load.prefill_tokens, load.prefill_s, load.prefill_s)
        if measured is not None:
            return measured
        key = (record.instance_id, record.incarnation)
        if key not in self._estimates:
            self._estimates[key] = _estimate(record, fallback)
        return self._estimates[key]

    def decide(self, now_s: float, records: Iterable[InstanceRecord], backlog_tokens: int,
               decode_demand: Mapping[str, float], fallback: LatencyModel, alive: bool,
               arrival_tokens_per_s: float | None = None) -> list[RoleChange]:  # fmt: skip
        """One observation (prompt tokens queued for prefill, Eq. 3's demand of each
        work list; the arrival velocity, default this proxy's own); the changes, 0 or
        1, already applied to :attr:`roles`."""
        if not alive:
            return []
        signals = self.signals(
            now_s, backlog_tokens=backlog_tokens, decode_demand=decode_demand,
            prefill_velocity={r.instance_id: self.prefill_velocity(r, fallback) for r in records},
            arrival_tokens_per_s=arrival_tokens_per_s,
        )  # fmt: skip
        changes = self.controller.observe(now_s, signals)
        for change in changes:
            self.switches[change.role] += 1
            self.changes.append({"t_s": now_s, "instance": change.instance, "role": change.role,
                                 "reason": change.reason, **self.controller.last})  # fmt: skip
            del self.changes[:-MAX_CHANGES]
            log.info("role_changed", instance=change.instance, role=change.role,
                     reason=change.reason, **self.controller.last)  # fmt: skip
        return changes

    async def refresh(self) -> None:
        """Decide (the lease's holder) or follow the record. Raises ``StoreError``."""
        if not self.enabled:
            return
        records = list(self.view.live.values())
        base = {r.instance_id: PREFILL if r.kind == "prefill" else DECODE for r in records}
        self.deciding = await self._lease(hold=True)
        if not self.deciding:
            raw = await self.store.get(ROLES)
            # (none: no decision yet, or the store lost it and the decider writes it again)
            self.record = decode_roles(raw) if raw is not None else self.record
            self.controller.track(base, self.record.roles)
            self._written = False  # (a replica that takes the lease over writes at once)
        else:
            self.controller.track(base)
            await self._decide(records)
        self.view.roles = self.roles

    async def _lease(self, hold: bool) -> bool:
        """Take or renew the roles lease (``hold``), or give it up if this replica holds
        it; whether it holds it now. Raises ``StoreError``."""
        me = self.proxy_id.encode()

        def claim(values: list[bytes | None]) -> tuple[dict[str, bytes | None], bool]:
            if values[0] not in (None, me):
                return {}, False
            return {ROLES_LEASE: me if hold else None}, hold

        return await self.store.transact([ROLES_LEASE], claim, ttl_s=LEASE_S)

    def store_lost(self) -> None:
        self._written = False  # (the decider writes the roles again at its next refresh)

    async def leave(self) -> None:
        """Give the lease up (another decides at once). Raises ``StoreError``."""
        self.deciding = await self._lease(hold=False)

    async def _decide(self, records: list[InstanceRecord]) -> None:
        now = time.monotonic()
        for r in records:  # (a record is rewritten every heartbeat, read every refresh)
            self.beat(r.instance_id, now, r.load.prefill_s)  # busy: seconds prefilled
        latency = self.view.latency()
        if latency is not None and records:
            backlog, demand = await self._shared_load(records, latency)
            arrivals = self.arrivals.rate(now) + await self._others_arrivals()
            alive = not any(r.draining for r in records)
            self.decide(now, records, backlog, demand, latency, alive,
                        arrival_tokens_per_s=arrivals)  # fmt: skip
        if not self._written or self.roles != self.record.roles:
            record = RolesRecord(v=1, roles=self.roles, proxy=self.proxy_id,
                                 changes=self.changes[-SHARED_CHANGES:])  # fmt: skip
            await self.store.put(ROLES, encode(record))
            self.record, self._written = record, True

    async def _shared_load(self, records: list[InstanceRecord], latency: LatencyModel
                           ) -> tuple[int, dict[str, float]]:  # fmt: skip
        """The backlog of every prefill queue and the decode demand of every work list."""
        # (with roles moving every instance may hold a prefill queue and a work list)
        keys = [RegistryView.queue_key(r, stage) for stage in ("prefill", "decode")
                for r in records]  # fmt: skip
        raws = await self.store.get_many(keys)
        ids = [r.instance_id for r in records]
        queues = [prefill_queue_of(raw) for raw in raws[: len(ids)] if raw is not None]
        lists = {i: work_list_of(raw) for i, raw in zip(ids, raws[len(ids) :], strict=True)}
        backlog = prefill_backlog(queues)
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
        """For ``/v1/aegaeon/stats``."""
        velocity = cluster_velocity(r.load.velocity for r in self.view.live.values())
        return {
            "enabled": self.enabled,
            "roles": self.roles,
            "base_roles": dict(self.controller.base_roles),
            "switches": dict(self.switches),
            "changes": list(self.record.changes),
            "signals": dict(self.controller.last),
            "arrival_tokens_per_s": self.arrivals.rate(now_s),
            "cluster_velocity": dict(velocity),
            "prefill_busy": dict(self.busy),
            "decider": self.record.proxy,
            "deciding": self.deciding,
        }


def _estimate(record: InstanceRecord, fallback: LatencyModel) -> float:
    models = tuple(record.capacity_tokens)
    if record.latency is not None:
        try:
            own = LatencyModel.from_dict(to_plain(record.latency))
            return estimated_prefill_velocity(own, models)
        except (KeyError, ValueError, ZeroDivisionError):
            pass  # a profile without prefill terms: the prefill instances' one
    try:
        return estimated_prefill_velocity(fallback, models)
    except (KeyError, ValueError, ZeroDivisionError):
        return 0.0
