"""The hook that picks the backend ``aegaeon proxy`` serves with.

The distributed backend (dispatch to prefill/decode instances over ZeroMQ)
is the product; ``aegaeon proxy --local`` uses the in-process engine instead
(development).
"""

from __future__ import annotations

from aegaeon_common.config import Config

from aegaeon_proxy.backend import Backend

__all__ = ["build_backend"]


def build_backend(config: Config) -> Backend:
    """The backend for a deployment described by ``config``: the distributed one."""
    from aegaeon_proxy.cluster.backend import ClusterBackend

    return ClusterBackend(config)
