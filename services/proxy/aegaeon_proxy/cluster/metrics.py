"""Prometheus text for the distributed backend's own counters."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aegaeon_proxy.cluster.backend import ClusterBackend


def render_metrics(backend: ClusterBackend) -> str:
    lines = [
        "# HELP aegaeon_backend_requests Requests the backend tracks now.",
        "# TYPE aegaeon_backend_requests gauge",
        f"aegaeon_backend_requests {len(backend.requests)}",
        "# HELP aegaeon_backend_requests_total Requests that ended, by outcome.",
        "# TYPE aegaeon_backend_requests_total counter",
    ]
    for outcome, count in sorted(backend.counters.items()):
        lines.append(f'aegaeon_backend_requests_total{{outcome="{outcome}"}} {count}')
    now = time.monotonic()
    lines += [
        "# HELP aegaeon_instance_up Whether an instance's heartbeat is current.",
        "# TYPE aegaeon_instance_up gauge",
    ]
    for view in backend.instances:
        lines.append(f'aegaeon_instance_up{{instance="{view.name}"}} {int(view.alive(now))}')
    lines += [
        "# HELP aegaeon_instance_counter Cumulative counters reported by instances.",
        "# TYPE aegaeon_instance_counter gauge",
    ]
    for view in backend.instances:
        if view.stats is None:
            continue
        for key, value in sorted(view.stats.counters.items()):
            lines.append(f'aegaeon_instance_counter{{instance="{view.name}",name="{key}"}} {value}')
    return "\n".join(lines) + "\n"
