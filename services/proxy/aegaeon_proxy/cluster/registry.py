"""A proxy replica's view of the instance registry in the shared store.

Refreshed every :data:`REFRESH_S`: the ids listed in ``instances`` whose record
has not expired are alive; an id whose record has expired is dead (its node
stopped beating) and is taken out of the list. Between refreshes the view is
what dispatch reads; a node that dies leaves it at most ``store.heartbeat_ttl``
+ :data:`REFRESH_S` later.

A record missing is a death only once the store has answered for a whole TTL
(:class:`StoreHealth`): until then the view keeps the records it had, as their
writers, who could not beat either, replace them within a beat.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.registry import (
    INSTANCES,
    InstanceRecord,
    decode_instance,
    instance_key,
    prefill_queue_key,
    work_list_key,
)
from aegaeon_common.store import Store
from aegaeon_common.wire import to_plain
from aegaeon_sched import LatencyModel

log = get_logger("registry")
REFRESH_S = 0.5


@dataclass
class StoreHealth:
    """Whether a record missing from the store may be taken for its writer's death: only
    once the store has answered for ``settle_s`` (a TTL and a refresh) since this replica
    last saw it fail, or saw it restarted empty (``troubled``)."""

    settle_s: float
    clock: Callable[[], float] = time.monotonic
    troubled_at: float = -math.inf
    num_troubles: int = 0

    def troubled(self) -> None:
        self.troubled_at = self.clock()
        self.num_troubles += 1

    def settled(self) -> bool:
        return self.clock() - self.troubled_at >= self.settle_s


@dataclass
class RegistryView:
    store: Store
    hybrid_prefill: bool  # prefill instances also decode (decode placement includes them)
    health: StoreHealth = field(default_factory=lambda: StoreHealth(0.0))
    live: dict[str, InstanceRecord] = field(default_factory=dict)
    # the roles decided (``cluster.roles``): instance -> "prefill" | "decode";
    # an instance not named has its kind's
    roles: dict[str, str] = field(default_factory=dict)
    _latency: tuple[tuple[str, int, tuple[str, ...]], LatencyModel] | None = None

    async def refresh(self) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        """Read the registry; returns (instances that joined, instances that left or
        restarted) since the last refresh. Raises ``StoreError``."""
        ids = sorted(await self.store.set_members(INSTANCES))
        raws = await self.store.get_many([instance_key(i) for i in ids])
        now: dict[str, InstanceRecord] = {}
        expired: list[str] = []
        for iid, raw in zip(ids, raws, strict=True):
            if raw is None:
                expired.append(iid)
                continue
            try:
                now[iid] = decode_instance(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("bad_registry_record", instance=iid, error=str(exc))
        if expired:  # anyone may tidy the index; a live instance adds itself again
            await self.store.set_remove(INSTANCES, *expired)
        if not self.health.settled():  # (its writer may not have beaten since: keep it)
            for iid, record in self.live.items():
                now.setdefault(iid, record)
        joined = [r for i, r in now.items()
                  if i not in self.live or self.live[i].incarnation != r.incarnation]  # fmt: skip
        left = [r for i, r in self.live.items()
                if i not in now or now[i].incarnation != r.incarnation]  # fmt: skip
        self.live = now
        return joined, left

    def alive(self, instance_id: str, incarnation: int) -> bool:
        record = self.live.get(instance_id)
        return record is not None and record.incarnation == incarnation

    def role(self, record: InstanceRecord) -> str:
        """Where new work for ``record`` goes: "prefill" or "decode"."""
        return self.roles.get(record.instance_id) or ("prefill" if record.kind == "prefill"
                                                      else "decode")  # fmt: skip

    def prefill_candidates(self) -> list[InstanceRecord]:
        """Every node's instances in the prefill role that take new work (Algorithm 1's
        I_P), the least busy node first.

        Algorithm 1 gives ties (equal queued prefill time, e.g. every queue empty) to
        the first instance, and decode placement stays on the prefill's node, so in
        registry order one node would take every request a short prefill queue lets
        through while the others idle. Ordered by the sequences each node holds (its
        instances' last heartbeats), ties go to the least busy node instead.
        """
        busy: dict[str, int] = {}
        for record in self.live.values():
            busy[record.node] = busy.get(record.node, 0) + record.load.open_sequences
        prefill = [r for r in self.live.values() if self.role(r) == "prefill" and not r.draining]
        return sorted(prefill, key=lambda r: (busy[r.node], r.instance_id))

    def decode_candidates(self, node: str) -> list[InstanceRecord]:
        """``node``'s instances that take decode work: decode instances first, then the
        hybrid prefill instances (Algorithm 2 breaks ties by order)."""
        mine = [r for r in self.live.values() if r.node == node and not r.draining]
        decode = [r for r in mine if r.kind == "decode"]
        return decode + ([r for r in mine if r.kind == "prefill"] if self.hybrid_prefill else [])

    def latency(self) -> LatencyModel | None:
        """A prefill instance's start-up profile (any instance's when none prefills):
        the estimates Algorithm 1 and the placement need (instances of a deployment
        share one hardware kind)."""
        profiled = [r for r in self.live.values() if r.latency is not None]
        record = min(profiled, key=lambda r: (r.kind != "prefill", r.instance_id), default=None)
        if record is None or record.latency is None:
            return None
        key = (record.instance_id, record.incarnation, tuple(record.latency.models))
        if self._latency is None or self._latency[0] != key:  # (read again once models are added)
            self._latency = (key, LatencyModel.from_dict(to_plain(record.latency)))
        return self._latency[1]

    @staticmethod
    def queue_key(record: InstanceRecord, stage: str) -> str:
        if stage == "prefill":
            return prefill_queue_key(record.instance_id, record.incarnation)
        return work_list_key(record.instance_id, record.incarnation)
