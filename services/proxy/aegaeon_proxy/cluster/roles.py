"""Prefill/decode role switching in the proxy: token velocity in, role changes out.

The policy (:mod:`aegaeon_sched.roles`) is pure; this is its driver, run by the
replica that decides the roles (``cluster.replica_roles``: every registry
refresh, :meth:`RoleSwitcher.decide`; on one node, that node's proxy). What an
instance says of its prefills reaches it as a :class:`Meter`, from its registry
record (its heartbeat):

* **arrival velocity**: prompt tokens/s arriving at the proxy (the requests it
  accepted, a short window: :class:`aegaeon_sched.Velocity`), the leading
  indicator of a burst;
* **backlog**: prompt tokens queued in the prefill queues of the store;
* **prefill velocity** per instance: prompt tokens per second of prefill work,
  measured from its heartbeat counters (``prefill_tokens`` / ``prefill_s``) once
  it has prefilled ``MIN_MEASURED_S``, estimated from its latency profile before;
* **prefill busy share** per instance (the growth of ``prefill_s`` between two
  heartbeats) and **decode demand** (Eq. 3's ``S`` of its work list in the store).

A change is carried out by dispatch alone (the roles record): with
``roles.enabled`` every instance runs the hybrid loop (``Config.role_switching``:
decode instances take prefill work on the hybrid channel), so no message tells
an instance its role.
An instance leaving the prefill role keeps its queued prefills, which run to
the end (standby); one joining it keeps its decode batches: no request moves,
no KV is handed anywhere new. While an instance is down or draining the roles
hold still (its capacity is unknown).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.registry import InstanceRecord
from aegaeon_common.wire import to_plain
from aegaeon_sched import (
    LatencyModel,
    RoleChange,
    RoleController,
    RoleSettings,
    RoleSignals,
    Velocity,
)
from aegaeon_sched.roles import DECODE, PREFILL, estimated_prefill_velocity

log = get_logger("cluster")

MIN_MEASURED_S = 0.2  # prefill seconds before an instance's measured rate replaces the estimate
MAX_CHANGES = 64  # role changes kept for /v1/aegaeon/stats

__all__ = ["Meter", "RoleSwitcher", "base_role", "record_meter", "settings_of"]


def base_role(kind: str) -> str:
    """An instance's configured role: its process kind."""
    return PREFILL if kind == "prefill" else DECODE


@dataclass(frozen=True)
class Meter:
    """What an instance's last heartbeat says of its prefills."""

    name: str
    incarnation: int
    prefill_s: float  # seconds spent prefilling since it started
    prefill_tokens: float  # prompt tokens prefilled since it started
    models: tuple[str, ...]
    latency: LatencyProfile | None  # its start-up profile, where it sent one


def record_meter(record: InstanceRecord) -> Meter:
    """An instance, from its registry record."""
    return Meter(record.instance_id, record.incarnation, record.load.prefill_s,
                 float(record.load.prefill_tokens), tuple(record.capacity_tokens),
                 record.latency)  # fmt: skip


def settings_of(config: Config) -> RoleSettings:
    r = config.roles
    return RoleSettings(
        high_util=r.high_util, low_util=r.low_util, up_hold_s=r.up_hold_s,
        down_hold_s=r.down_hold_s, min_dwell_s=r.min_dwell_s,
        backlog_horizon_s=r.backlog_horizon_s or config.slo.ttft_s / 2,
        decode_high=r.decode_high, convert_max_demand=r.convert_max_demand,
        min_prefill=r.min_prefill, min_decode=r.min_decode,
    )  # fmt: skip


class RoleSwitcher:
    """Feeds :class:`~aegaeon_sched.RoleController` from heartbeats (see the module
    docstring). With ``enabled`` false it only keeps the velocities (metrics, stats):
    every instance keeps its configured role."""

    def __init__(self, config: Config, base_roles: Mapping[str, str], enabled: bool) -> None:
        self.enabled = enabled
        self.controller = RoleController(base_roles, settings_of(config))
        self.arrivals = Velocity()
        self.busy: dict[str, float] = {}  # instance -> prefill busy share, last heartbeats
        self._prev: dict[str, tuple[float, float]] = {}  # instance -> (t, prefill_s)
        self._estimates: dict[tuple[str, int], float] = {}  # (instance, incarnation) -> tok/s
        self.switches: Counter[str] = Counter()  # new role -> changes
        self.changes: list[dict[str, object]] = []  # the last MAX_CHANGES, for stats

    @property
    def roles(self) -> dict[str, str]:
        return dict(self.controller.roles)

    def role(self, instance: str) -> str:
        return self.controller.roles.get(instance, DECODE)

    def arrived(self, now_s: float, prompt_tokens: int) -> None:
        self.arrivals.add(now_s, prompt_tokens)

    def heartbeat(self, meter: Meter | None, now_s: float) -> None:
        """Update the instance's prefill busy share from its latest heartbeat."""
        if meter is None:
            return
        prev = self._prev.get(meter.name)
        if prev is not None and now_s > prev[0] and meter.prefill_s >= prev[1]:
            self.busy[meter.name] = min(1.0, (meter.prefill_s - prev[1]) / (now_s - prev[0]))
        self._prev[meter.name] = (now_s, meter.prefill_s)

    def prefill_velocity(self, meter: Meter, fallback: LatencyModel) -> float:
        """Prompt tokens/s the instance prefills while busy: measured, else estimated."""
        if meter.prefill_s >= MIN_MEASURED_S:
            return meter.prefill_tokens / meter.prefill_s
        key = (meter.name, meter.incarnation)
        if key not in self._estimates:
            self._estimates[key] = self._estimate(meter, fallback)
        return self._estimates[key]

    @staticmethod
    def _estimate(meter: Meter, fallback: LatencyModel) -> float:
        if meter.latency is not None:
            try:
                own = LatencyModel.from_dict(to_plain(meter.latency))
                return estimated_prefill_velocity(own, meter.models)
            except (KeyError, ValueError, ZeroDivisionError):
                pass  # a profile without prefill terms: the prefill instances' one
        try:
            return estimated_prefill_velocity(fallback, meter.models)
        except (KeyError, ValueError, ZeroDivisionError):
            return 0.0

    def decide(self, now_s: float, meters: Iterable[Meter], backlog_tokens: int,
               decode_demand: Mapping[str, float], fallback: LatencyModel, alive: bool,
               arrival_tokens_per_s: float | None = None) -> list[RoleChange]:  # fmt: skip
        """One observation (prompt tokens queued for prefill, Eq. 3's demand of each
        work list; the arrival velocity, default this proxy's own); the changes, 0 or
        1, already applied to :attr:`roles`."""
        if not self.enabled or not alive:
            return []
        arrivals = self.arrivals.rate(now_s) if arrival_tokens_per_s is None \
            else arrival_tokens_per_s
        signals = RoleSignals(
            arrival_tokens_per_s=arrivals,
            backlog_tokens=backlog_tokens,
            prefill_velocity={m.name: self.prefill_velocity(m, fallback) for m in meters},
            decode_demand=dict(decode_demand),
            prefill_busy=dict(self.busy),
        )
        changes = self.controller.observe(now_s, signals)
        for change in changes:
            self.switches[change.role] += 1
            self.changes.append({"t_s": now_s, "instance": change.instance, "role": change.role,
                                 "reason": change.reason, **self.controller.last})  # fmt: skip
            del self.changes[:-MAX_CHANGES]
            log.info("role_changed", instance=change.instance, role=change.role,
                     reason=change.reason, **self.controller.last)  # fmt: skip
        return changes

    def snapshot(self, now_s: float, velocity: Mapping[str, float]) -> dict[str, object]:
        """For ``/v1/aegaeon/stats``: roles, what they were decided on, changes;
        ``velocity``: the cluster's tokens/s by stage."""
        return {
            "enabled": self.enabled,
            "roles": self.roles,
            "base_roles": dict(self.controller.base_roles),
            "switches": dict(self.switches),
            "changes": list(self.changes),
            "signals": dict(self.controller.last),
            "arrival_tokens_per_s": self.arrivals.rate(now_s),
            "cluster_velocity": dict(velocity),
            "prefill_busy": dict(self.busy),
        }
