"""Prefill/decode role switching in the proxy: token velocity in, role changes out.

The policy (:mod:`aegaeon_sched.roles`) is pure; this is its driver. Every
instance heartbeat feeds it one observation (:meth:`RoleSwitcher.observe`):

* **arrival velocity**: prompt tokens/s arriving at the proxy (the requests it
  accepted, a short window: :class:`aegaeon_sched.Velocity`), the leading
  indicator of a burst;
* **backlog**: prompt tokens queued in the policy's prefill queues, plus
  arrivals held while no instance could prefill;
* **prefill velocity** per instance: prompt tokens per second of prefill work,
  measured from its heartbeat counters (``prefill_tokens`` / ``prefill_s``) once
  it has prefilled ``MIN_MEASURED_S``, estimated from its latency profile before;
* **prefill busy share** per instance (the growth of ``prefill_s`` between two
  heartbeats) and **decode demand** (Eq. 3's ``S`` of its work list, from the
  policy's decode dispatcher).

A change is carried out by :meth:`AegaeonPolicy.set_role
<aegaeon_sched.AegaeonPolicy.set_role>` alone: with ``roles.enabled`` every
instance runs the hybrid loop (``Config.role_switching``: decode instances take
prefill work on the hybrid channel), so no message tells an instance its role.
An instance leaving the prefill role keeps its queued prefills, which run to
the end (standby); one joining it keeps its decode batches: no request moves,
no KV is handed anywhere new. While an instance is down or draining the roles
hold still (its capacity is unknown).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.wire import to_plain
from aegaeon_sched import (
    AegaeonPolicy,
    LatencyModel,
    RoleChange,
    RoleController,
    RoleSettings,
    RoleSignals,
    Velocity,
    cluster_velocity,
)
from aegaeon_sched.roles import DECODE, PREFILL, estimated_prefill_velocity

from aegaeon_proxy.cluster.instances import InstanceView

log = get_logger("cluster")

MIN_MEASURED_S = 0.2  # prefill seconds before an instance's measured rate replaces the estimate
MAX_CHANGES = 64  # role changes kept for /v1/aegaeon/stats

__all__ = ["RoleSwitcher", "base_role", "settings_of"]


def base_role(view: InstanceView) -> str:
    """An instance's configured role: its process kind."""
    return PREFILL if view.kind == "prefill" else DECODE


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

    def __init__(self, config: Config, views: Iterable[InstanceView], enabled: bool) -> None:
        self.enabled = enabled
        self.controller = RoleController({v.name: base_role(v) for v in views},
                                         settings_of(config))  # fmt: skip
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

    def heartbeat(self, view: InstanceView, now_s: float) -> None:
        """Update ``view``'s prefill busy share from its latest heartbeat."""
        if view.stats is None:
            return
        prefill_s = float(view.stats.counters.get("prefill_s", 0.0))
        prev = self._prev.get(view.name)
        if prev is not None and now_s > prev[0] and prefill_s >= prev[1]:
            self.busy[view.name] = min(1.0, (prefill_s - prev[1]) / (now_s - prev[0]))
        self._prev[view.name] = (now_s, prefill_s)

    def prefill_velocity(self, view: InstanceView, fallback: LatencyModel) -> float:
        """Prompt tokens/s ``view`` prefills while busy: measured, else estimated."""
        counters = view.stats.counters if view.stats is not None else {}
        busy_s = float(counters.get("prefill_s", 0.0))
        if busy_s >= MIN_MEASURED_S:
            return float(counters.get("prefill_tokens", 0.0)) / busy_s
        key = (view.name, view.incarnation)
        if key not in self._estimates:
            self._estimates[key] = self._estimate(view, fallback)
        return self._estimates[key]

    @staticmethod
    def _estimate(view: InstanceView, fallback: LatencyModel) -> float:
        hello = view.hello
        models = list(hello.capacity_tokens) if hello is not None else []
        if hello is not None and hello.latency is not None:
            try:
                own = LatencyModel.from_dict(to_plain(hello.latency))
                return estimated_prefill_velocity(own, models)
            except (KeyError, ValueError, ZeroDivisionError):
                pass  # a profile without prefill terms: the prefill instances' one
        try:
            return estimated_prefill_velocity(fallback, models)
        except (KeyError, ValueError, ZeroDivisionError):
            return 0.0

    def observe(
        self, now_s: float, policy: AegaeonPolicy, views: list[InstanceView], alive: bool
    ) -> list[RoleChange]:
        """One observation; the changes to carry out (``policy.set_role``), 0 or 1.
        ``alive``: every instance is up and none is draining (else nothing changes)."""
        if not self.enabled or not alive:
            return []
        backlog = sum(q.pending_tokens() for q in policy.prefill.queues.values())
        backlog += sum(r.prompt_len for r in policy.held_arrivals.values())
        decode = policy.decode
        signals = RoleSignals(
            arrival_tokens_per_s=self.arrivals.rate(now_s),
            backlog_tokens=backlog,
            prefill_velocity={v.name: self.prefill_velocity(v, policy.latency) for v in views},
            decode_demand={i: decode.demand(i) for i in decode.work_lists},
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

    def cluster_velocity(self, views: Iterable[InstanceView]) -> dict[str, float]:
        """Tokens/s by stage summed over the instances' last heartbeats."""
        return cluster_velocity(v.stats.velocity for v in views if v.stats is not None)

    def snapshot(self, now_s: float, views: list[InstanceView]) -> dict[str, object]:
        """For ``/v1/aegaeon/stats``: roles, what they were decided on, changes."""
        return {
            "enabled": self.enabled,
            "roles": self.roles,
            "base_roles": dict(self.controller.base_roles),
            "switches": dict(self.switches),
            "changes": list(self.changes),
            "signals": dict(self.controller.last),
            "arrival_tokens_per_s": self.arrivals.rate(now_s),
            "cluster_velocity": self.cluster_velocity(views),
            "prefill_busy": dict(self.busy),
        }
