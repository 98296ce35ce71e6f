"""The distributed backend's state as metrics, read at scrape time (reads only)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aegaeon_proxy.cluster.instances import InstanceView


class CollectedBackend(Protocol):
    """What a scrape reads of the backend (``cluster.backend.ClusterBackend``)."""

    @property
    def instances(self) -> Iterable[InstanceView]: ...

    @property
    def requests(self) -> Sized: ...

    @property
    def counters(self) -> Mapping[str, int]: ...

    def held_counts(self) -> tuple[int, int]: ...

__all__ = ["ClusterCollector"]

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
        yield GaugeMetricFamily(
            "aegaeon_backend_requests", "Requests the backend tracks now", value=len(b.requests)
        )
        held = GaugeMetricFamily(
            "aegaeon_held_requests",
            "Requests waiting in the proxy because every instance of a stage is paused",
            labels=["stage"],
        )
        arrivals, placements = b.held_counts()
        held.add_metric(["prefill"], float(arrivals))
        held.add_metric(["decode"], float(placements))
        yield held
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
        for name, count in sorted(b.counters.items()):
            family = ended if name in ENDINGS else events
            family.add_metric([name], float(count))
        yield ended
        yield events
