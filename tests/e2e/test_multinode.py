"""Many nodes behind a replicated proxy layer, through a real redis-server.

``aegaeon serve --nodes 2 --proxies 2`` on loopback: two nodes (each a
cachemgr, a prefill and a decode instance, its own process group and run
directory), two proxy replicas, one Redis. Outcomes only: every request is
served or ends with a clean error, a dead proxy loses only its own streams,
a dead node leaves dispatch once its heartbeat records expire, and the shared queues
are empty when the load is over.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml
from http_support import call_json, get_json, metric_samples, sse_events
from serve_harness import Served, serving, until

MODELS = ("llama-gqa-5m", "mistral-11m", "qwen2-19m")


@pytest.fixture(scope="module")
def cluster(
    small_market: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    run_dir = tmp_path_factory.mktemp("multinode") / "run"
    with serving(small_market, run_dir, "--nodes", "2", "--proxies", "2",
                 "--store-url", redis_url) as served:  # fmt: skip
        yield served


def _models(market: Path) -> list[str]:
    names = [m["name"] for m in json.loads((market / "market.json").read_text())["models"]]
    return [n for n in MODELS if n in names] or names[:3]


async def _stream(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int,
                  started: asyncio.Queue[None] | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed completion: how it ended (finish reason, error code, or a cut)."""
    body = {"model": model, "prompt": "tell me a story " * 4, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    out: dict[str, Any] = {"tokens": 0, "finish": None, "error": None, "status": None}
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=90)) as resp:  # fmt: skip
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = f"http {resp.status}"
                return out
            async for _, data in sse_events(resp):
                if data is None:
                    break
                if "error" in data:
                    out["error"] = data["error"].get("code") or "error"
                    continue
                if started is not None and data.get("choices"):
                    started.put_nowait(None)
                    started = None
                if data.get("usage"):
                    out["tokens"] = data["usage"]["completion_tokens"]
                for choice in data.get("choices") or ():
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        out["error"] = f"cut: {type(exc).__name__}"
    finally:
        if started is not None:  # ended before its first token: the waiter sees it now,
            started.put_nowait(None)  # and the test its error, not a timeout
    return out


def _stats(url: str) -> dict[str, Any]:
    data = get_json(f"{url}/v1/aegaeon/stats?light=1")
    assert isinstance(data, dict)
    return data


def _nodes_seen(url: str) -> list[str] | None:
    """The nodes a replica dispatches to, or None while it does not answer."""
    try:
        status, stats = call_json(url, "GET", "/v1/aegaeon/stats?light=1")
    except OSError:  # connection refused (restarting), or a reset
        return None
    return list(stats["nodes"]) if status == 200 else None


def _shared_queues_empty(redis_url: str) -> bool:
    import msgspec

    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter("aegaeon:pq:*"):
            state = msgspec.msgpack.decode(client.get(key) or b"[null, 0, []]")
            if state[2]:
                return False
        for key in client.scan_iter("aegaeon:dw:*"):
            if msgspec.msgpack.decode(client.get(key) or b"[]"):
                return False
        return True
    finally:
        client.close()


def _host_kv_owned(cluster: Served) -> dict[str, float]:
    """Unified CPU KV cache blocks leased, by node and owner, and those freed but waiting
    for their copy (its cachemgr's metrics)."""
    owned: dict[str, float] = {}
    for node in ("node-0", "node-1"):
        url = json.loads((cluster.run_dir / node / "cachemgr.http").read_text())["url"]
        for (name, labels), value in metric_samples(f"{url}/metrics").items():
            if name == "aegaeon_kv_blocks_owned" and value:
                owned[f"{node}/{dict(labels)['owner']}"] = value
            elif name == "aegaeon_kv_cache_move_list_blocks" and value:
                owned[f"{node}/(move list)"] = value  # freed, copy pending
    return owned


def _node_pids(cluster: Served, node: str) -> list[int]:
    """The node's supervisor and every service of it (their ready files hold pids)."""
    return sorted({int(p.read_text()) for p in (cluster.run_dir / node).glob("*.ready")})


def test_both_replicas_serve_every_model_on_both_nodes(
    cluster: Served, small_market: Path, redis_url: str
) -> None:
    urls = cluster.urls
    models = _models(small_market)

    async def load() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            jobs = [_stream(session, urls[i % 2], models[i % len(models)], 24) for i in range(12)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(load())
    assert [r["finish"] for r in results] == ["length"] * 12, results
    assert all(r["tokens"] == 24 for r in results), results
    for url in urls:  # each replica reads both nodes from the registry
        assert _stats(url)["nodes"] == ["node-0", "node-1"]
    until("every shared queue empty", lambda: _shared_queues_empty(redis_url), 5)


def test_a_killed_proxy_loses_only_its_own_streams(cluster: Served, small_market: Path,
                                                   redis_url: str) -> None:  # fmt: skip
    urls = cluster.urls
    models = _models(small_market)
    victim_pid = int((cluster.run_dir / "proxy-1" / "proxy.ready").read_text())
    victim_id = _stats(urls[1])["proxy_id"]

    async def load() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with aiohttp.ClientSession() as session:
            first: asyncio.Queue[None] = asyncio.Queue()
            on_victim = [asyncio.ensure_future(_stream(session, urls[1], m, 600, first))
                         for m in models]  # fmt: skip
            survivors = [asyncio.ensure_future(_stream(session, urls[0], m, 48))
                         for m in models * 2]  # fmt: skip
            for _ in on_victim:  # every victim stream is under way
                await asyncio.wait_for(first.get(), 60)
            os.kill(victim_pid, signal.SIGKILL)
            return list(await asyncio.gather(*on_victim)), list(await asyncio.gather(*survivors))

    cut, served = asyncio.run(load())
    assert all(r["finish"] == "length" and r["tokens"] == 48 for r in served), served
    assert all(r["error"] is not None and r["finish"] is None for r in cut), cut
    # a surviving replica reaps the dead one's requests (cancelled at their instances)
    client = redis.Redis.from_url(redis_url)

    def reaped() -> bool:
        return (not client.exists(f"aegaeon:proxyreqs:{victim_id}")
                and not client.sismember("aegaeon:proxies", victim_id))  # fmt: skip

    # its records expire (store.heartbeat_ttl)
    until("the dead replica's requests reaped", reaped, 60)
    client.close()
    until("every shared queue empty", lambda: _shared_queues_empty(redis_url), 60)
    until("no instance holds a sequence of the dead replica",
          lambda: all(i["open_sequences"] == 0 for i in _stats(urls[0])["instances"]), 15)
    # nor KV: a handoff the dead replica got but never placed is freed at its prefill
    until(lambda: f"no KV block left leased (held: {_host_kv_owned(cluster)})",
          lambda: not _host_kv_owned(cluster), 30)


def test_a_killed_node_leaves_dispatch(cluster: Served, small_market: Path,
                                       redis_url: str) -> None:  # fmt: skip
    urls = cluster.urls
    # both replicas answer (the one killed before is the supervisor's to restart: a
    # stream sent to it while it starts is refused a connection) and see both nodes
    until("both replicas up, both nodes in their view",
          lambda: all(_nodes_seen(url) == ["node-0", "node-1"] for url in urls), 60)
    models = _models(small_market)
    client = redis.Redis.from_url(redis_url)
    victims: list[str] = []

    def busiest_node() -> str:
        counts = {"node-0": 0, "node-1": 0}
        for key in client.scan_iter("aegaeon:req:*"):
            import msgspec

            meta = msgspec.msgpack.decode(client.get(key) or b"{}")
            node = str(meta.get("instance", "")).partition("/")[0] if meta else ""
            if node in counts:
                counts[node] += 1
        return max(counts, key=lambda n: counts[n])

    async def load() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            first: asyncio.Queue[None] = asyncio.Queue()
            jobs = [asyncio.ensure_future(_stream(session, urls[i % 2], models[i % len(models)],
                                                  600, first))
                    for i in range(8)]
            for _ in jobs:  # every stream is under way
                await asyncio.wait_for(first.get(), 60)
            victim = await asyncio.to_thread(busiest_node)
            victims.append(victim)
            for pid in _node_pids(cluster, victim):
                os.kill(pid, signal.SIGKILL)
            later = [asyncio.ensure_future(_stream(session, urls[i % 2], models[i % len(models)],
                                                   16))
                     for i in range(4)]
            return list(await asyncio.gather(*jobs, *later))

    results = asyncio.run(load())
    client.close()
    # every request is accounted for: served in full, or a clean instance_failed error
    for r in results:
        assert r["finish"] == "length" or r["error"] == "instance_failed", results
    assert any(r["error"] == "instance_failed" for r in results), results
    # the node left dispatch: what was sent after the kill went to the other node
    assert all(r["finish"] == "length" for r in results[8:]), results[8:]
    # the supervisor starts the node again: it registers and takes new work
    def rejoined(url: str) -> bool:  # both of its instances are in this replica's view
        kinds = {i["kind"] for i in _stats(url)["instances"] if i["node"] == victims[0]}
        return kinds >= {"prefill", "decode"}

    until("the node rejoined", lambda: all(rejoined(url) for url in urls), 150)
    before = _queue_keys(redis_url, cluster, victims[0])

    async def more() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*(
                _stream(session, urls[i % 2], models[i % len(models)], 32) for i in range(8))))

    assert all(r["finish"] == "length" for r in asyncio.run(more()))
    assert _queue_keys(redis_url, cluster, victims[0]) - before, "the rejoined node got no work"


def _queue_keys(redis_url: str, cluster: Served, node: str) -> set[bytes]:
    """The node's shared queue keys: one per instance process that got work (under the
    run's own namespace, from its node's config)."""
    config = yaml.safe_load((cluster.run_dir / node / "config.yaml").read_text())
    client = redis.Redis.from_url(redis_url)
    try:
        return set(client.scan_iter(f"{config['store']['namespace']}:pq:{node}/*"))
    finally:
        client.close()
