"""The backend's state as metrics, read at scrape time (reads only): its instances,
held requests and store (:class:`BackendCollector`), the request table's
(:func:`request_metrics`) and the roles' (:func:`role_metrics`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from aegaeon_common.store import Store
from aegaeon_sched.velocity import STAGES, cluster_velocity
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aegaeon_proxy.cluster.requests import RequestTable
from aegaeon_proxy.cluster.roles import SharedRoles

__all__ = ["BackendCollector", "request_metrics", "role_metrics"]

ENDINGS = frozenset({"finished", "failed", "cancelled"})  # the backend's request outcomes


Rows = Iterable[tuple[tuple[str, ...], float]]  # (label values, value) of each sample


def _family(kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str,
            labels: list[str], rows: Rows) -> Metric:
    """A labelled family, one sample per row."""
    family = kind(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(list(values), float(value))
    return family


@dataclass(eq=False)  # (a registry keys its collectors by identity)
class BackendCollector(Collector):
    """``down``: the instances that report here and are not up (one node: every
    instance it runs is listed); ``held``: the arrivals and decode placements held."""

    table: RequestTable
    roles: SharedRoles  # (and the registry view dispatch reads)
    store: Store
    down: Callable[[], list[str]]
    held: Callable[[], tuple[int, int]]

    def collect(self) -> Iterator[Metric]:
        live = self.roles.view.live
        yield _family(GaugeMetricFamily, "aegaeon_instance_up", "Instances registered and beating",
                      ["instance"], [*(((i,), 1.0) for i in live),
                                     *(((name,), 0.0) for name in self.down())])  # fmt: skip
        yield _family(GaugeMetricFamily, "aegaeon_instance_draining",
                      "Whether an instance announced it is draining", ["instance"],
                      (((i,), r.draining) for i, r in live.items()))  # fmt: skip
        yield from request_metrics(self.table)
        yield from role_metrics(self.roles)
        yield _family(GaugeMetricFamily, "aegaeon_held_requests",
                      "Requests waiting in the proxy because no instance of a stage takes work now",
                      ["stage"], zip([("prefill",), ("decode",)], self.held(), strict=True))
        yield _family(CounterMetricFamily, "aegaeon_store_transactions",
                      "Store transactions by outcome", ["outcome"],
                      [(("committed",), self.store.num_commits),
                       (("conflict",), self.store.num_conflicts)])  # fmt: skip


def role_metrics(roles: SharedRoles) -> Iterator[Metric]:
    """Token velocity (each instance's by stage, from its last heartbeat), the roles
    (the view's: dispatch's) and their changes (those ``roles`` made: each change is
    counted by the proxy that decided it)."""
    view = roles.view
    velocity = {r.instance_id: r.load.velocity for r in view.live.values()}
    yield _family(
        GaugeMetricFamily, "aegaeon_instance_velocity_tokens_per_second",
        "Token velocity of an instance by stage (arrival, prefill, decode; TokenScale "
        "III-B), from its last heartbeat", ["instance", "stage"],
        (((name, stage), stages.get(stage, 0.0)) for name, stages in velocity.items()
         for stage in STAGES),
    )  # fmt: skip
    yield _family(GaugeMetricFamily, "aegaeon_cluster_velocity_tokens_per_second",
                  "The cluster's token velocity by stage: its instances' summed", ["stage"],
                  (((stage,), rate) for stage, rate in cluster_velocity(velocity.values()).items()))
    yield GaugeMetricFamily(
        "aegaeon_proxy_arrival_velocity_tokens_per_second",
        "Prompt tokens per second arriving at the proxy (the role policy's leading signal)",
        value=roles.arrivals.rate(time.monotonic()),
    )  # fmt: skip
    yield _family(GaugeMetricFamily, "aegaeon_instance_role",
                  "1 for an instance's current role (prefill or decode)", ["instance", "role"],
                  (((name, kind), view.role(record) == kind) for name, record in view.live.items()
                   for kind in ("prefill", "decode")))  # fmt: skip
    yield _family(CounterMetricFamily, "aegaeon_role_switches",
                  "Instances moved between the prefill and decode roles, by the role taken",
                  ["role"], (((kind,), roles.switches.get(kind, 0))
                             for kind in ("prefill", "decode")))  # fmt: skip


def request_metrics(table: RequestTable) -> Iterator[Metric]:
    """The request table's families: requests tracked now, ended by outcome, the
    other events, and shedding by SLO class."""
    yield GaugeMetricFamily(
        "aegaeon_backend_requests", "Requests the backend tracks now", value=len(table.requests)
    )
    counts = sorted(table.counters.items())
    yield _family(CounterMetricFamily, "aegaeon_backend_requests_ended",
                  "Requests the backend ended, by outcome", ["outcome"],
                  (((name,), n) for name, n in counts if name in ENDINGS))  # fmt: skip
    yield _family(
        CounterMetricFamily, "aegaeon_backend_events", "What the backend did besides ending "
        "requests: retried (dispatched again after an instance failed), rejected (429), "
        "orphans_cancelled, bad_frames (undecodable reports), report_errors", ["event"],
        (((name,), n) for name, n in counts if name not in ENDINGS),
    )  # fmt: skip
    shedder = table.shedder
    if shedder is not None:
        yield GaugeMetricFamily(
            "aegaeon_deferred_requests",
            "Requests waiting in the proxy for admission room (deferred by SLO class)",
            value=len(shedder),
        )  # fmt: skip
        yield _family(
            CounterMetricFamily, "aegaeon_shed_requests", "Requests shed under overload by SLO "
            "class: deferred (waited in the proxy) or refused (429)", ["slo_class", "verdict"],
            [*(((name, "refused"), n) for name, n in sorted(shedder.refused.items())),
             (("*", "deferred"), shedder.num_deferred)],
        )  # fmt: skip
