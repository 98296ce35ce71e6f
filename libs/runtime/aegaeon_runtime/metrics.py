"""A worker instance's metrics (its side port's ``GET /metrics``).

The compute thread updates prometheus_client counters and histograms and
the token velocity (:class:`~aegaeon_sched.velocity.Velocity` windows under
a lock; no torch); :class:`InstanceCollector` reads the rest at scrape time
on the event loop: the queue depths the compute thread publishes
(:class:`InstanceLoad`, a frozen value replaced whole), the active model, and
the device KV pool's counts. A scrape changes nothing the scheduler reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from aegaeon_common.logs import get_logger
from aegaeon_common.messages.report import SwitchRecord
from aegaeon_common.metrics import SWITCH_BUCKETS_S, kv_block_counts, new_registry
from aegaeon_gpumem import KVBlockPool
from aegaeon_sched.velocity import STAGES, Velocity
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class WorkerState(Protocol):
    """What the collector reads of a built worker (``aegaeon_runtime.worker.Worker``)."""

    @property
    def switcher(self) -> _Switcher: ...

    @property
    def kv(self) -> _KV: ...


class _Switcher(Protocol):
    @property
    def active_model(self) -> str | None: ...


class _KV(Protocol):
    @property
    def pool(self) -> KVBlockPool: ...


__all__ = ["STAGES", "InstanceCollector", "InstanceLoad", "WorkerMetrics"]

log = get_logger("switch")

# aegaeon_token_velocity_tokens_per_second{stage} (TokenScale §III-B, STAGES): tokens
# of work arriving (prompt tokens to prefill, KV tokens handed in to decode), prompt
# tokens prefilled, tokens decoded; per second over this trailing window.
VELOCITY_WINDOW_S = 10.0


@dataclass(frozen=True)
class InstanceLoad:
    """Queue depths, published by the compute thread (one assignment: a reader
    sees a whole value)."""

    prefill_requests: int = 0  # queued or running
    prefill_groups: int = 0
    decode_requests: int = 0  # in the work list
    decode_batches: int = 0


class WorkerMetrics:
    """What one instance counts; every method may be called from any thread."""

    def __init__(self, instance: str, registry: CollectorRegistry | None = None) -> None:
        self.instance = instance
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self._requests = Counter(
            "aegaeon_instance_requests",
            "Requests an instance finished a stage of, by stage (prefill|decode) and outcome "
            "(prefill: ok|failed; decode: stop|length|cancelled|failed)",
            ("instance", "stage", "model", "outcome"), registry=r,
        )  # fmt: skip
        self._tokens = Counter(
            "aegaeon_instance_tokens", "Tokens by stage (arrival|prefill|decode) and model",
            ("instance", "stage", "model"), registry=r,
        )  # fmt: skip
        self._switches = Counter(
            "aegaeon_model_switches", "Model switches (scale-ups), by whether the model was "
            "prefetched", ("instance", "prefetched"), registry=r,
        )  # fmt: skip
        self._switch_s = Histogram(
            "aegaeon_model_switch_duration_seconds",
            "A switch's time on the critical path, by whether the model was prefetched",
            ("instance", "prefetched"), buckets=SWITCH_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._bad_frames = Counter(
            "aegaeon_bad_frames", "Command frames dropped: not a message of the channel "
            "(code: the WireError's) or work queued for a previous process (stale)",
            ("instance", "code"), registry=r,
        )  # fmt: skip
        self._velocity = {stage: Velocity(VELOCITY_WINDOW_S) for stage in STAGES}
        self._velocity_lock = threading.Lock()  # counted on the compute thread, read on the loop

    def bad_frame(self, code: str) -> None:
        self._bad_frames.labels(self.instance, code).inc()

    def request_done(self, stage: str, model: str, outcome: str) -> None:
        self._requests.labels(self.instance, stage, model, outcome).inc()

    def tokens(self, stage: str, model: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self._tokens.labels(self.instance, stage, model).inc(num_tokens)
            with self._velocity_lock:
                self._velocity[stage].add(time.monotonic(), num_tokens)

    def velocity(self) -> dict[str, float]:
        """Tokens per second over the last ``VELOCITY_WINDOW_S``, by stage."""
        now_s = time.monotonic()
        with self._velocity_lock:
            return {stage: rate.rate(now_s) for stage, rate in self._velocity.items()}

    def switch(self, record: SwitchRecord) -> None:
        """Count a serving switch and log it, one line with its breakdown."""
        log.info(
            "switch", instance=self.instance, from_model=record.from_model,
            to_model=record.to_model, total_s=round(record.total_s, 6),
            load_s=round(record.load_s, 6),
            other_s=round(max(0.0, record.total_s - record.load_s), 6),
            prefetched=record.prefetched,
        )  # fmt: skip
        prefetched = "true" if record.prefetched else "false"
        self._switches.labels(self.instance, prefetched).inc()
        self._switch_s.labels(self.instance, prefetched).observe(record.total_s)


class InstanceCollector(Collector):
    """Gauges read at scrape time; ``worker()`` and ``load()`` give None / an
    empty load until the worker is built."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        worker: Callable[[], WorkerState | None],
        load: Callable[[], InstanceLoad],
    ) -> None:
        self._metrics = metrics
        self._worker = worker
        self._load = load

    def collect(self) -> Iterator[Metric]:
        name = self._metrics.instance
        velocity = GaugeMetricFamily(
            "aegaeon_token_velocity_tokens_per_second",
            "Tokens per second over the last 10 s, by stage (TokenScale §III-B)",
            labels=["instance", "stage"],
        )
        for stage, rate in self._metrics.velocity().items():
            velocity.add_metric([name, stage], rate)
        yield velocity
        load = self._load()
        depths = [
            ("aegaeon_prefill_queue_requests", "Requests queued or running for prefill",
             load.prefill_requests),
            ("aegaeon_prefill_queue_groups", "Groups in the prefill job queue (Alg. 1)",
             load.prefill_groups),
            ("aegaeon_decode_worklist_requests", "Requests in the decode work list",
             load.decode_requests),
            ("aegaeon_decode_worklist_batches", "Batches in the decode work list (Alg. 2)",
             load.decode_batches),
        ]  # fmt: skip
        for metric, help_text, value in depths:
            family = GaugeMetricFamily(metric, help_text, labels=["instance"])
            family.add_metric([name], float(value))
            yield family
        worker = self._worker()
        if worker is None:
            return
        active = GaugeMetricFamily(
            "aegaeon_active_model", "1 for the model an instance's weights hold now",
            labels=["instance", "model"],
        )  # fmt: skip
        current = worker.switcher.active_model
        if current is not None:
            active.add_metric([name, current], 1.0)
        yield active
        blocks = GaugeMetricFamily(
            "aegaeon_kv_blocks", "KV blocks by shape and state (used|free)",
            labels=["instance", "location", "shape", "state"],
        )  # fmt: skip
        for shape, used, free in kv_block_counts(worker.kv.pool.stats().slabs):
            blocks.add_metric([name, "device", shape, "used"], float(used))
            blocks.add_metric([name, "device", shape, "free"], float(free))
        yield blocks
