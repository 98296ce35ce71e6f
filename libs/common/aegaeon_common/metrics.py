"""What every service's ``/metrics`` shares: a registry per process, names, rates.

Metrics are prometheus_client objects in a :class:`CollectorRegistry` of the
service's own (never the library's global one, so tests can run several
services in one process). Counters a compute thread updates are
prometheus_client counters (thread-safe); gauges that mirror scheduling state
are read at scrape time by a collector that only reads (a scrape never changes
what is scheduled).

Names follow Prometheus conventions: an ``aegaeon_`` prefix, base units in
the name (``_seconds``, ``_bytes``), ``_total`` on counters. Labels:
``instance`` ("prefill-0", "decode-1"), ``model``, ``stage``, ``outcome``,
``shape`` (:func:`shape_label`), ``location`` ("device" | "cpu"), ``state``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

__all__ = [
    "SWITCH_BUCKETS_S",
    "TBT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "kv_block_counts",
    "new_registry",
    "shape_label",
]

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TBT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
SWITCH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def new_registry() -> CollectorRegistry:
    """A registry for one service process, with the process collector (RSS, open
    fds, CPU seconds: ``process_*``) and the platform collector (``python_info``)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def shape_label(key: Iterable[object]) -> str:
    """A KV shape key ``(layers, kv_heads, head_dim, block_size, dtype[, parts])`` as a
    label: ``"L30-H3-D64-B16-bfloat16"``; a tensor-parallel group's (a block split over
    ``parts`` ranks, each device block one part) ends ``-P2``."""
    layers, heads, head_dim, block, dtype, *parts = tuple(key)
    tail = f"-P{parts[0]}" if parts else ""
    return f"L{layers}-H{heads}-D{head_dim}-B{block}-{dtype}{tail}"


def kv_block_counts(stats: Any) -> list[tuple[str, int, int]]:
    """``(shape label, used blocks, free blocks)`` for each shape a slab allocator
    has seen (``stats``: an ``aegaeon_gpumem.SlabStats``; this package imports no
    torch); free = free blocks in the shape's slabs + what the empty slabs hold."""
    out = []
    for key, shape in stats.shapes.items():
        per_slab = stats.slab_bytes // shape.block_bytes if shape.block_bytes else 0
        free = shape.free_blocks + stats.free_slabs * per_slab
        out.append((shape_label(key), int(shape.used_blocks), int(free)))
    return out
