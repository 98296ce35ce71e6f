"""The backend's state as metrics, read at scrape time (reads only): its instances,
held requests and store (:class:`BackendCollector`), the request table's
(:func:`request_metrics`) and the roles' (:func:`role_metrics`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aegaeon_common.store import Store
from aegaeon_sched.velocity import STAGES, cluster_velocity
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.requests import RequestTable
from aegaeon_proxy.cluster.roles import SharedRoles

__all__ = ["BackendCollector", "request_metrics", "role_metrics"]

ENDINGS = frozenset({"finished", "failed", "cancelled"})  # the backend's request outcomes


@dataclass(eq=False)  # (a registry keys its collectors by identity)
class BackendCollector(Collector):
    """``down``: the instances that report here and are not up (one node: every
    instance it runs is listed); ``held``: the arrivals and decode placements held."""

    view: RegistryView
    table: RequestTable
    roles: SharedRoles
    store: Store
    down: Callable[[], list[str]]
    held: Callable[[], tuple[int, int]]

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("aegaeon_instance_up", "Instances registered and beating",
                               labels=["instance"])  # fmt: skip
        draining = GaugeMetricFamily(
            "aegaeon_instance_draining", "Whether an instance announced it is draining",
            labels=["instance"],
        )  # fmt: skip
        for iid, record in self.view.live.items():
            up.add_metric([iid], 1.0)
            draining.add_metric([iid], float(record.draining))
        for name in self.down():
            up.add_metric([name], 0.0)
        yield up
        yield draining
        yield from request_metrics(self.table)
        yield from role_metrics(self.roles, self.view)
        held = GaugeMetricFamily(
            "aegaeon_held_requests",
            "Requests waiting in the proxy because no instance of a stage takes work now",
            labels=["stage"],
        )  # fmt: skip
        prefill, decode = self.held()
        held.add_metric(["prefill"], float(prefill))
        held.add_metric(["decode"], float(decode))
        yield held
        tx = CounterMetricFamily("aegaeon_store_transactions", "Store transactions by outcome",
                                 labels=["outcome"])  # fmt: skip
        tx.add_metric(["committed"], float(self.store.num_commits))
        tx.add_metric(["conflict"], float(self.store.num_conflicts))
        yield tx


def role_metrics(roles: SharedRoles, view: RegistryView) -> Iterator[Metric]:
    """Token velocity (each instance's by stage, from its last heartbeat), the roles
    (``view``'s: dispatch's) and their changes (those ``roles`` made: each change is
    counted by the proxy that decided it)."""
    velocity = {r.instance_id: r.load.velocity for r in view.live.values()}
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
    for name, record in view.live.items():
        current = view.role(record)
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
        "aegaeon_backend_requests", "Requests the backend tracks now", value=len(table.requests)
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
