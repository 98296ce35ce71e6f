"""Every node's cachemgr as the proxy reaches it: at the command address its
instances name in their registry records (``addresses.cachemgr``: one on another
host must be routable from the proxies), for the model operations
(``cluster.models``), every node's Model Cache merged into one, and every node's
services (``GET /v1/aegaeon/services``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import zmq.asyncio
from aegaeon_common.http_side import ServiceAddress
from aegaeon_common.messages.cache import REPLIES, CacheStats, GetStats
from aegaeon_common.registry import InstanceRecord
from aegaeon_common.transport import RemoteError, RpcClient
from aegaeon_common.wire import Message, to_plain

from aegaeon_proxy.backend import BackendError

__all__ = ["CACHE_TIMEOUT_S", "NodeCaches", "merge_model_caches", "node_services"]

CACHE_TIMEOUT_S = 10.0

# cachemgr ErrorReply codes -> (HTTP status, error code) of the admin endpoints
_CACHE_ERRORS: dict[str, tuple[int, str]] = {
    "unknown_model": (404, "model_not_found"),
    "model_cache_full": (409, "model_cache_full"),
    "checkpoint_error": (422, "model_unavailable"),
}

SUMMED = ("budget_bytes", "used_bytes", "num_loads", "num_hits", "num_evictions",
          "load_s_total", "loaded_bytes_total")  # fmt: skip


def _cachemgrs(records: Iterable[InstanceRecord]) -> dict[str, str]:
    """node -> its cachemgr's command address (as its instances last wrote it)."""
    out: dict[str, str] = {}
    for r in sorted(records, key=lambda r: r.instance_id):
        if r.cachemgr_address:
            out.setdefault(r.node, r.cachemgr_address)
    return out


def node_services(records: Iterable[InstanceRecord]) -> list[ServiceAddress]:
    """Each node's cachemgr, then its prefill and decode instances, nodes in order (named
    by their instance ids: ``node/prefill-0``, and ``prefill-0`` on one node)."""
    by_node: dict[str, list[InstanceRecord]] = {}
    for r in records:
        by_node.setdefault(r.node, []).append(r)
    out: list[ServiceAddress] = []
    for _node, mine in sorted(by_node.items()):
        cachemgr = next((r.cachemgr_http_url for r in mine if r.cachemgr_http_url), "")
        if cachemgr:  # named as its node's instances are: "node/cachemgr" (one node: none)
            prefix = mine[0].instance_id.removesuffix(f"{mine[0].kind}-{mine[0].index}")
            out.append(ServiceAddress(f"{prefix}cachemgr", "cachemgr", cachemgr))
        for r in sorted(mine, key=lambda r: (r.kind != "prefill", r.index)):
            if r.http_url:
                out.append(ServiceAddress(r.instance_id, r.kind, r.http_url))
    return out


def merge_model_caches(by_node: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Many nodes' Model Caches as one (``ModelCacheStats`` as plain data): a model is
    resident, pinned and known where it is on *every* node, unavailable where it is on
    any; its load progress is the least of the nodes'; the byte and load counts are
    summed; ``nodes`` keeps each."""
    caches = list(by_node.values())
    out: dict[str, Any] = {key: sum(c.get(key, 0) for c in caches) for key in SUMMED}
    resident = [{m["name"]: m for m in c.get("models", [])} for c in caches]
    everywhere = set.intersection(*(set(r) for r in resident)) if resident else set()
    out["models"] = [m for name, m in resident[0].items() if name in everywhere] if caches else []
    out["loading"] = sorted({name for c in caches for name in c.get("loading", [])})
    out["progress"] = {
        name: min(1.0 if name in r else float(c.get("progress", {}).get(name, 0.0))
                  for c, r in zip(caches, resident, strict=True))
        for name in {n for c in caches for n in c.get("progress", {})} - everywhere
    }  # fmt: skip
    for key in ("operator_pinned", "known"):
        sets = [set(c.get(key, [])) for c in caches]
        out[key] = sorted(set.intersection(*sets)) if sets else []
    # a model one node cannot read is unavailable (the first node's words for it)
    out["unavailable"] = {name: why for c in reversed(caches)
                          for name, why in c.get("unavailable", {}).items()}  # fmt: skip
    out["nodes"] = dict(by_node)
    return out


class NodeCaches:
    """One client per node's cachemgr, made on first use."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._clients: dict[str, RpcClient] = {}  # address -> client

    async def call(self, address: str, msg: Message,
                   timeout_s: float = CACHE_TIMEOUT_S) -> Message:  # fmt: skip
        """``msg`` to the cachemgr at ``address``; raises :class:`BackendError`: a refusal
        as the admin endpoints answer it (an unreadable checkpoint's message is the
        cachemgr's own: it names the file, what the model is quarantined for)."""
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RpcClient(self._ctx, address, REPLIES)
        try:
            return await client.call(msg, timeout_s=timeout_s)
        except TimeoutError:
            raise BackendError.unavailable(f"the cachemgr at {address} did not answer") from None
        except RemoteError as exc:
            status, code = _CACHE_ERRORS.get(exc.code, (503, "unavailable"))
            why = exc.reply.message if exc.code == "checkpoint_error" else f"cachemgr: {exc}"
            raise BackendError(why, status=status, code=code) from None

    async def call_all(self, records: Iterable[InstanceRecord], msg: Message,
                       timeout_s: float = CACHE_TIMEOUT_S) -> list[Message]:  # fmt: skip
        """``msg`` to every node's cachemgr at once; their replies. The first failure
        is raised (after every call ended: the nodes that took it keep it)."""
        nodes = _cachemgrs(records)
        if not nodes:
            raise BackendError.unavailable("no node has registered its cachemgr")
        results = await asyncio.gather(*(self.call(a, msg, timeout_s) for a in nodes.values()),
                                       return_exceptions=True)  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]

    async def stats(
        self, records: Iterable[InstanceRecord], timeout_s: float = CACHE_TIMEOUT_S
    ) -> dict[str, CacheStats | None]:
        """By node (None: it did not answer within ``timeout_s``)."""
        nodes = _cachemgrs(records)

        async def one(address: str) -> CacheStats | None:
            try:
                reply = await self.call(address, GetStats(), timeout_s)
            except BackendError:
                return None
            return reply if isinstance(reply, CacheStats) else None

        answers = await asyncio.gather(*(one(a) for a in nodes.values()))
        return dict(zip(nodes, answers, strict=True))

    async def model_cache(self, records: Iterable[InstanceRecord],
                          timeout_s: float = CACHE_TIMEOUT_S) -> dict[str, Any] | None:  # fmt: skip
        """The Model Caches that answer, merged; None when none did."""
        by_node = {node: to_plain(stats.model_cache)
                   for node, stats in (await self.stats(records, timeout_s)).items()
                   if stats is not None}  # fmt: skip
        return merge_model_caches(by_node) if by_node else None

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
