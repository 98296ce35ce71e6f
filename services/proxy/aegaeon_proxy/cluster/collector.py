"""A backend's state as metrics, read at scrape time (reads only): the request table's
(:func:`request_metrics`, every backend), the roles (:func:`role_metrics`, every
backend) and the single proxy's instances."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from aegaeon_sched.velocity import STAGES, cluster_velocity
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aegaeon_proxy.cluster.instances import InstanceView
from aegaeon_proxy.cluster.requests import RequestTable
from aegaeon_proxy.cluster.roles import RoleSwitcher


class CollectedBackend(Protocol):
    """What a scrape reads of the backend (``cluster.backend.ClusterBackend``)."""

    @property
    def instances(self) -> Iterable[InstanceView]: ...

    @property
    def table(self) -> RequestTable: ...

    @property
    def roles(self) -> RoleSwitcher: ...

    def held_counts(self) -> tuple[int, int]: ...

__all__ = ["ClusterCollector", "request_metrics", "role_metrics"]

ENDINGS = frozenset({"finished", "failed", "cancelled"})  # the backend's request outcomes


class ClusterCollector(Collector):
    """Instances as the proxy sees them (heartbeats, drains), requests it tracks."""

    def __init__(self, backend: CollectedBackend) -> None:
        self._backend = backend

    def collect(self) -> Iterator[Metric]:
        b = self._backend
        now = time.monotonic()
        up = GaugeMetricFamily(
            "aegaeon_instance_up", "Whether an instance's heartbeat is current", labels=["instance"]
        )
        draining = GaugeMetricFamily(
            "aegaeon_instance_draining", "Whether an instance announced it is draining",
            labels=["instance"],
        )  # fmt: skip
        for view in b.instances:
            up.add_metric([view.name], float(view.alive(now)))
            draining.add_metric([view.name], float(view.draining))
        yield up
        yield draining
        held = GaugeMetricFamily(
            "aegaeon_held_requests",
            "Requests waiting in the proxy because every instance of a stage is paused",
            labels=["stage"],
        )
        arrivals, placements = b.held_counts()
        held.add_metric(["prefill"], float(arrivals))
        held.add_metric(["decode"], float(placements))
        yield held
        yield from request_metrics(b.table)
        yield from self._velocity_and_roles()

    def _velocity_and_roles(self) -> Iterator[Metric]:
        b = self._backend
        velocity = {v.name: v.stats.velocity if v.stats is not None else {} for v in b.instances}
        yield from role_metrics(b.roles, velocity)


def role_metrics(roles: RoleSwitcher, velocity: Mapping[str, Mapping[str, float]]
                 ) -> Iterator[Metric]:  # fmt: skip
    """Token velocity (``velocity``: each instance's by stage, from its last heartbeat),
    the roles and their changes (those ``roles`` made: each change is counted by the
    proxy that decided it)."""
    per_instance = GaugeMetricFamily(
        "aegaeon_instance_velocity_tokens_per_second",
        "Token velocity of an instance by stage (arrival, prefill, decode; TokenScale "
        "III-B), from its last heartbeat", labels=["instance", "stage"],
    )  # fmt: skip
    for name, stages in velocity.items():
        for stage in STAGES:
            per_instance.add_metric([name, stage], float(stages.get(stage, 0.0)))
    yield per_instance
    cluster = GaugeMetricFamily(
        "aegaeon_cluster_velocity_tokens_per_second",
        "The cluster's token velocity by stage: its instances' summed", labels=["stage"],
    )  # fmt: skip
    for stage, rate in cluster_velocity(velocity.values()).items():
        cluster.add_metric([stage], rate)
    yield cluster
    yield GaugeMetricFamily(
        "aegaeon_proxy_arrival_velocity_tokens_per_second",
        "Prompt tokens per second arriving at the proxy (the role policy's leading signal)",
        value=roles.arrivals.rate(time.monotonic()),
    )  # fmt: skip
    role = GaugeMetricFamily(
        "aegaeon_instance_role", "1 for an instance's current role (prefill or decode)",
        labels=["instance", "role"],
    )  # fmt: skip
    for name in velocity:
        current = roles.role(name)
        for kind in ("prefill", "decode"):
            role.add_metric([name, kind], float(current == kind))
    yield role
    switches = CounterMetricFamily(
        "aegaeon_role_switches", "Instances moved between the prefill and decode roles, "
        "by the role taken", labels=["role"],
    )  # fmt: skip
    for kind in ("prefill", "decode"):
        switches.add_metric([kind], float(roles.switches.get(kind, 0)))
    yield switches


def request_metrics(table: RequestTable) -> Iterator[Metric]:
    """The request table's families: requests tracked now, ended by outcome, the
    other events, and shedding by SLO class."""
    yield GaugeMetricFamily(
        "aegaeon_backend_requests", "Requests the backend tracks now", value=len(table)
    )
    ended = CounterMetricFamily(
        "aegaeon_backend_requests_ended", "Requests the backend ended, by outcome",
        labels=["outcome"],
    )  # fmt: skip
    events = CounterMetricFamily(
        "aegaeon_backend_events", "What the backend did besides ending requests: "
        "retried (dispatched again after an instance failed), rejected (429), "
        "orphans_cancelled, bad_frames (undecodable reports), report_errors",
        labels=["event"],
    )  # fmt: skip
    for name, count in sorted(table.counters.items()):
        family = ended if name in ENDINGS else events
        family.add_metric([name], float(count))
    yield ended
    yield events
    shedder = table.shedder
    if shedder is not None:
        yield GaugeMetricFamily(
            "aegaeon_deferred_requests",
            "Requests waiting in the proxy for admission room (deferred by SLO class)",
            value=len(shedder),
        )  # fmt: skip
        shed = CounterMetricFamily(
            "aegaeon_shed_requests", "Requests shed under overload by SLO class: "
            "deferred (waited in the proxy) or refused (429)", labels=["slo_class", "verdict"],
        )  # fmt: skip
        for name, count in sorted(shedder.refused.items()):
            shed.add_metric([name, "refused"], float(count))
        shed.add_metric(["*", "deferred"], float(shedder.num_deferred))
        yield shed
