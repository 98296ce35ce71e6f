"""The cachemgr's metrics: Model Cache, unified CPU KV cache, leases, requests.

Counters of requests are prometheus_client counters updated by the request
handler; the rest is read from the manager at scrape time, on the event loop
that owns it (reads only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from aegaeon_common.metrics import kv_block_counts
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from aegaeon_cachemgr.manager import CacheManager

__all__ = ["CacheCollector", "request_counter"]

INSTANCE = "cachemgr"


def request_counter(registry: CollectorRegistry) -> Counter:
    """``aegaeon_cachemgr_requests_total{type, outcome}``: requests answered, by message
    tag and outcome (ok, or the error code)."""
    return Counter(
        "aegaeon_cachemgr_requests", "Requests the cachemgr answered, by type and outcome",
        ("type", "outcome"), registry=registry,
    )  # fmt: skip


class CacheCollector(Collector):
    def __init__(self, manager: CacheManager) -> None:
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        m = self._manager
        models = m.models
        kv = m.kv.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        plain: list[tuple[Callable[..., Metric], str, str, float]] = [
            (g, "aegaeon_model_cache_used_bytes", "Model Cache bytes resident or being loaded",
             models.used_bytes),
            (g, "aegaeon_model_cache_capacity_bytes", "Model Cache budget", models.budget_bytes),
            (c, "aegaeon_model_cache_hits", "Model Cache lookups found resident", models.num_hits),
            (c, "aegaeon_model_cache_misses", "Model Cache lookups that waited for a load",
             models.num_misses),
            (c, "aegaeon_model_cache_evictions", "Models evicted (LRU)", models.num_evictions),
            (c, "aegaeon_model_cache_loads", "Models loaded from disk", models.num_loads),
            (c, "aegaeon_model_cache_loaded_bytes", "Bytes loaded from disk",
             models.loaded_bytes_total),
            (c, "aegaeon_model_cache_load_seconds", "Time spent loading from disk",
             models.load_s_total),
            (c, "aegaeon_model_quarantines", "Models made unavailable because their "
             "checkpoint could not be read (missing, truncated, corrupt, or not as market.json "
             "records)", models.num_quarantines),
            (g, "aegaeon_kv_cache_capacity_bytes", "Unified CPU KV cache size", kv.capacity_bytes),
            (g, "aegaeon_kv_cache_used_bytes", "Bytes of live KV blocks", kv.used_bytes),
            (g, "aegaeon_kv_cache_held_bytes", "Bytes of slabs given to a shape", kv.held_bytes),
            (g, "aegaeon_kv_cache_move_list_blocks", "Freed blocks waiting for their copy event",
             kv.move_list_blocks),
            (g, "aegaeon_cachemgr_workers", "Workers holding a lease", len(m.workers.leases())),
        ]  # fmt: skip
        for kind, name, help_text, value in plain:
            yield kind(name, help_text, value=float(value))
        stats = models.stats()
        resident = GaugeMetricFamily(
            "aegaeon_model_cache_models", "Models in the Model Cache, by state",
            labels=["state"],
        )  # fmt: skip
        resident.add_metric(["resident"], float(len(stats.models)))
        resident.add_metric(["loading"], float(len(stats.loading)))
        resident.add_metric(["unavailable"], float(len(stats.unavailable)))
        yield resident
        progress = GaugeMetricFamily(
            "aegaeon_model_load_progress_ratio",
            "Share of each served model's bytes in the Model Cache (1: resident, between: "
            "loading, 0: on disk only)", labels=["model"],
        )  # fmt: skip
        for model in stats.known:
            progress.add_metric([model], models.progress(model))
        yield progress
        freed = CounterMetricFamily(
            "aegaeon_kv_cache_freed_blocks", "Unified KV cache blocks freed, at once or after "
            "the event of a copy still in flight (through the move list)", labels=["when"],
        )  # fmt: skip
        freed.add_metric(["now"], float(kv.freed_blocks))
        freed.add_metric(["after_event"], float(kv.deferred_blocks))
        yield freed
        blocks = GaugeMetricFamily(
            "aegaeon_kv_blocks", "KV blocks by shape and state (used|free)",
            labels=["instance", "location", "shape", "state"],
        )  # fmt: skip
        for shape, used, free in kv_block_counts(m.kv.slab_stats()):
            blocks.add_metric([INSTANCE, "cpu", shape, "used"], float(used))
            blocks.add_metric([INSTANCE, "cpu", shape, "free"], float(free))
        yield blocks
        owned = GaugeMetricFamily(
            "aegaeon_kv_blocks_owned", "Unified KV cache blocks leased to each worker",
            labels=["owner"],
        )  # fmt: skip
        for owner, count in kv.blocks_per_owner.items():
            owned.add_metric([owner], float(count))
        yield owned
