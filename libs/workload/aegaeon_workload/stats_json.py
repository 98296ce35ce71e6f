"""Reading ``GET /v1/aegaeon/stats`` answers, the live ones and the recorded ones.

Since the reliability work, ``instances`` is a list of what each instance holds
(``kv_blocks_in_use``, ``leases``, ``open_sequences``) and each instance's last
heartbeat (counters, active model) lives in ``instance_stats``, by name. Traces
recorded before that carry the heartbeats as a dict in ``instances``;
:func:`heartbeats` reads both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["heartbeats", "holdings", "instance_counter"]


def heartbeats(stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """Each instance's last heartbeat (``InstanceStats`` as JSON, or None) by name."""
    if not stats:
        return {}
    by_name = stats.get("instance_stats")
    if isinstance(by_name, dict):
        return by_name
    recorded = stats.get("instances")
    return recorded if isinstance(recorded, dict) else {}


def instance_counter(stats: Mapping[str, Any] | None, name: str) -> float:
    """The sum of one counter over every instance's last heartbeat."""
    return sum((float(((h or {}).get("counters") or {}).get(name, 0.0))
               for h in heartbeats(stats).values()), 0.0)  # fmt: skip


def holdings(stats: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The ``instances`` list (what each instance holds now); [] for a recorded dict."""
    listed = (stats or {}).get("instances")
    return [i for i in listed if isinstance(i, dict)] if isinstance(listed, list) else []
