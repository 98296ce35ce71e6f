"""The hook that picks the backend ``aegaeon proxy`` serves with.

The distributed backend (dispatch to prefill/decode instances over ZeroMQ)
plugs in here; until it exists, the proxy command refuses to start rather
than serve from something that is not the product.
"""

from __future__ import annotations

from aegaeon_common.config import Config

from aegaeon_proxy.backend import Backend

__all__ = ["build_backend"]


def build_backend(config: Config) -> Backend:
    """The backend for a deployment described by ``config``."""
    raise NotImplementedError(
        "the distributed backend (prefill/decode instances over ZeroMQ) is not written yet; "
        "for development use aegaeon_proxy.local_backend.LocalEngineBackend"
    )
