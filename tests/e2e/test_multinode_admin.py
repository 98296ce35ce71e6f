"""What one node does, many nodes do too: ``aegaeon serve --nodes 2 --proxies 2``.

Through a real redis-server, against the replicated proxies: a ``PATCH`` of a
model's settings (a pin reaches every node's cachemgr, as on one node), batch
requests shed before interactive ones at a replica's admission bounds (the
same request table and shedder as one node), and ``GET /v1/aegaeon/services``
listing every node's cachemgr and instances; a PATCH on one replica reaches the
other (the settings live in the store). A model added (``POST
/v1/aegaeon/models``) on one replica is served through the other and removed
(``DELETE``) through it again; ``/sleep`` on one replica is seen by the other's
``/is_sleeping`` (the cluster serves part of the market, as the single-node
lifecycle test does). A LoRA adapter loaded (``/v1/load_lora_adapter``) on one
replica is served through the other, on every node, and unloaded through it; a
bad one is a 400 on either. Roles move (``roles.enabled``, thresholds any burst
crosses): one replica decides, both dispatch by the same roles, a decode
instance takes the prefill role and every request completes. Outcomes only: no
timing is asserted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from http_support import call_json, get_text, metric_samples, post_text
from serve_harness import Served, is_sleeping, serve_config, serving, stream_completion, until

SETTLE_S = 120.0  # loads and heartbeats settle within this (a busy CI machine)
MAX_TOKENS = 200  # a request's KV: ceil((prompt + 200) / 16) = 13-16 blocks
KV_BLOCKS = 32  # each replica's bound: one such batch request (0.5 x 32), two interactive
DEFERRED = 3  # batch requests that wait behind the first
# roles move on any burst and stay moved (no turning back on decode pressure), as in
# test_serve_classes' single node
ROLES = {"enabled": True, "high_util": 0.001, "low_util": 0.0005, "up_hold": 0.0,
         "down_hold": 600.0, "min_dwell": 0.5, "decode_high": 1e9, "convert_max_demand": 1.0}
BURST = 8  # requests of the roles' burst, through both replicas


@pytest.fixture(scope="module")
def cluster(small_market: Path, market_names: list[str], redis_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # fmt: skip
    """Two nodes, two replicas, serving the market's first two models (the others are
    added at run time)."""
    models = [{"name": n, "path": str(small_market / n)} for n in market_names[:2]]
    config = serve_config(small_market, models=models, proxy={"max_kv_blocks": KV_BLOCKS},
                          roles=ROLES)  # fmt: skip
    run_dir = tmp_path_factory.mktemp("multinode-admin") / "run"
    with serving(small_market, run_dir, "--nodes", "2", "--proxies", "2",
                 "--store-url", redis_url, config=config) as served:  # fmt: skip
        yield served


@pytest.fixture(scope="module")
def model(market_names: list[str]) -> str:
    return market_names[0]


def _until(what: str, check: Any, timeout_s: float = SETTLE_S) -> Any:
    return until(what, check, timeout_s)


def _both_nodes_up(url: str) -> bool:
    try:
        nodes = call_json(url, "GET", "/v1/aegaeon/stats?light=1")[1]["nodes"]
        return bool(nodes == ["node-0", "node-1"])
    except OSError:
        return False


def _services(url: str) -> list[dict[str, str]]:
    status, body = call_json(url, "GET", "/v1/aegaeon/services")
    assert status == 200, body
    return list(body["services"])


def _settings(url: str, model: str) -> tuple[bool, int | None]:
    status, row = call_json(url, "GET", f"/v1/aegaeon/models/{model}")
    assert status == 200, row
    return row["pinned"], row["max_concurrency"]


def _load_progress(metrics_url: str) -> dict[str, float]:
    return {dict(labels)["model"]: value
            for (name, labels), value in metric_samples(metrics_url).items()
            if name == "aegaeon_model_load_progress_ratio"}  # fmt: skip


def test_services_list_every_nodes_cachemgr_and_instances(cluster: Served) -> None:
    urls = cluster.urls
    _until("both replicas see both nodes", lambda: all(_both_nodes_up(u) for u in urls))

    def listed() -> list[dict[str, str]] | None:
        services = _services(urls[1])
        names = [s["name"] for s in services]
        want = ["proxy", "node-0/cachemgr", "node-0/prefill-0", "node-0/decode-0",
                "node-1/cachemgr", "node-1/prefill-0", "node-1/decode-0"]  # fmt: skip
        return services if names == want else None

    services = _until("every node's services listed", listed)
    assert [s["role"] for s in services] == ["proxy", *["cachemgr", "prefill", "decode"] * 2]
    for service in services[1:]:  # each answers where it says
        for key in ("health_url", "ready_url", "metrics_url"):
            assert get_text(service[key])[0] == 200, (service["name"], key)


def test_patch_pins_a_model_on_every_node(cluster: Served, model: str) -> None:
    urls = cluster.urls
    _until("both replicas see both nodes", lambda: all(_both_nodes_up(u) for u in urls))
    status, row = call_json(urls[0], "PATCH", f"/v1/aegaeon/models/{model}",
                        {"pinned": True, "max_concurrency": 8})  # fmt: skip
    assert status == 200, row
    assert row["pinned"] is True and row["max_concurrency"] == 8
    _until("the other replica shows the new settings",
           lambda: _settings(urls[1], model) == (True, 8))  # fmt: skip

    def resident() -> dict[str, Any] | None:
        status, body = call_json(urls[0], "GET", f"/v1/aegaeon/models/{model}")
        assert status == 200, body
        return body if body["in_model_cache"] and body["load_progress"] == 1.0 else None

    row = _until("the pinned model is resident on both nodes", resident)
    assert row["bytes"] > 0
    status, body = call_json(urls[0], "GET", "/v1/aegaeon/models")
    assert status == 200 and body["model_cache"] is not None, body
    # each node's cachemgr holds it as the operator's, and says so in its metrics
    cachemgrs = [s for s in _services(urls[0]) if s["role"] == "cachemgr"]
    assert len(cachemgrs) == 2
    for service in cachemgrs:
        assert _load_progress(service["metrics_url"]).get(model) == 1.0, service["name"]
    # the same field errors as one node
    status, body = call_json(urls[0], "PATCH", f"/v1/aegaeon/models/{model}", {"pinned": "yes"})
    assert status == 400 and body["error"]["param"] == "pinned"
    status, body = call_json(urls[0], "PATCH", "/v1/aegaeon/models/no-such-model", {"pin": True})
    assert status == 404
    status, row = call_json(urls[1], "PATCH", f"/v1/aegaeon/models/{model}",
                        {"pinned": False, "max_concurrency": None})  # fmt: skip
    assert status == 200 and row["pinned"] is False
    _until("the first replica shows the settings of the second's PATCH",
           lambda: _settings(urls[0], model) == (False, None))  # fmt: skip


def test_batch_is_shed_before_interactive_at_a_replicas_bounds(cluster: Served,
                                                               model: str) -> None:  # fmt: skip
    url = cluster.urls[0]
    _until("the replica sees both nodes", lambda: _both_nodes_up(url))

    def body(k: int, priority: str) -> dict[str, Any]:
        return {"model": model, "prompt": f"request {k}", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "priority": priority}  # fmt: skip

    async def shedding(session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"{url}/v1/aegaeon/stats?light=1") as resp:
            stats = await resp.json()
        return dict(stats["slo_classes"]["shedding"])

    async def main() -> tuple[list[tuple[int, str | None]], dict[str, int], dict[str, Any],
                              dict[str, Any]]:  # fmt: skip
        firsts: dict[str, int] = {}  # each stream's place among the first tokens
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            before = await shedding(session)
            api = f"{url}/v1"
            first = asyncio.ensure_future(stream_completion(session, api, body(0, "batch"),
                                                            firsts, "b0"))  # fmt: skip
            while "b0" not in firsts:  # admitted and under way: the bound is held
                assert not first.done(), first.result()
                await asyncio.sleep(0.02)
            batch = [asyncio.ensure_future(stream_completion(session, api, body(k, "batch"), firsts,
                                                             f"b{k}"))
                     for k in range(1, DEFERRED + 1)]  # fmt: skip
            while (await shedding(session))["deferred"] < DEFERRED:  # each waits its turn
                await asyncio.sleep(0.02)
            urgent = await stream_completion(session, api, body(99, "interactive"), firsts, "i")
            results = [await first, *await asyncio.gather(*batch), urgent]
            return results, firsts, before, await shedding(session)

    results, firsts, before, after = asyncio.run(main())
    assert all(r == (200, "length") for r in results), results
    # the batch requests past their class's half of the bound waited; the interactive one,
    # with headroom past the bound, never did: admitted at once, its first token before
    # theirs (they wait for the first batch request's whole KV to be freed)
    assert after["deferred_total"] - before["deferred_total"] == DEFERRED, (before, after)
    assert after["refused_by_class"] == before["refused_by_class"], (before, after)
    assert all(firsts["i"] < firsts[f"b{k}"] for k in range(1, DEFERRED + 1)), firsts


def _complete(url: str, model: str) -> tuple[int, Any]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    status, answer = call_json(url, "POST", "/v1/completions", body)
    return status, answer


def _listed(url: str) -> list[str]:
    return [m["id"] for m in call_json(url, "GET", "/v1/models")[1]["data"]]


def test_a_model_added_on_one_replica_is_served_and_removed_through_the_other(
    cluster: Served, market_names: list[str]
) -> None:
    a, b = cluster.urls
    _until("both replicas see both nodes", lambda: all(_both_nodes_up(u) for u in (a, b)))
    configured, extra = market_names[:2], market_names[2]
    assert _listed(a) == configured and _listed(b) == configured
    status, body = _complete(b, extra)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # the same errors as one node: not in the market, already served, a bad field
    status, body = call_json(a, "POST", "/v1/aegaeon/models", {"name": "no-such-model"})
    assert status == 404 and body["error"]["code"] == "model_not_in_market"
    status, body = call_json(a, "POST", "/v1/aegaeon/models", {"name": configured[0]})
    assert status == 409 and body["error"]["code"] == "model_exists"
    status, body = call_json(a, "POST", "/v1/aegaeon/models", {"name": extra, "pin": 1})
    assert status == 400 and body["error"]["param"] == "pin"

    status, row = call_json(a, "POST", "/v1/aegaeon/models", {"name": extra})
    assert status == 201 and row["state"] == "serving" and row["source"] == "runtime", row
    assert _complete(a, extra)[0] == 200
    _until("the other replica serves it", lambda: extra in _listed(b))
    status, done = _complete(b, extra)
    assert status == 200 and done["usage"]["completion_tokens"] == 4, done
    # every node's cachemgr knows it: a pin through the other replica loads it on both
    status, row = call_json(b, "PATCH", f"/v1/aegaeon/models/{extra}", {"pinned": True})
    assert status == 200 and row["pinned"] is True, row
    _until("the first replica shows the pin", lambda: _settings(a, extra)[0] is True)
    cachemgrs = [s for s in _services(a) if s["role"] == "cachemgr"]
    assert len(cachemgrs) == 2
    for service in cachemgrs:
        url = service["metrics_url"]
        _until(f"{extra} loaded on {service['name']}",
               lambda: _load_progress(url).get(extra) == 1.0)  # noqa: B023  # fmt: skip

    # removed through the other replica: 404 on both, and again
    status, body = call_json(b, "DELETE", f"/v1/aegaeon/models/{extra}")
    assert status in (200, 202) and body["state"] in ("removed", "removing"), body
    status, body = _complete(b, extra)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    _until("the first replica no longer serves it", lambda: _complete(a, extra)[0] == 404)
    assert extra not in _listed(a)
    assert call_json(a, "GET", f"/v1/aegaeon/models/{extra}")[0] == 404
    assert call_json(a, "DELETE", f"/v1/aegaeon/models/{extra}")[0] == 404
    assert _complete(a, configured[0])[0] == 200  # the others are served as before


def test_sleep_on_one_replica_is_seen_by_the_other(cluster: Served, model: str) -> None:
    a, b = cluster.urls
    _until("both replicas see both nodes", lambda: all(_both_nodes_up(u) for u in (a, b)))
    assert _complete(a, model)[0] == 200  # on a device of the node that served it
    _until("awake on both replicas",
           lambda: not is_sleeping(a, model) and not is_sleeping(b, model))

    status, body = call_json(a, "POST", f"/sleep?model={model}")
    assert status == 200 and body == {"is_sleeping": True, "models": {model: True}}, body
    _until("asleep on the other replica (the instances' next heartbeats)",
           lambda: is_sleeping(b, model))  # fmt: skip
    status, body = call_json(b, "POST", f"/wake_up?model={model}")
    assert status == 200 and body["is_sleeping"] is False, body
    _until("awake on the first replica", lambda: not is_sleeping(a, model))

    # asleep again, a request for it is served: its prefill switches it in
    status, body = call_json(b, "POST", f"/sleep?model={model}")
    assert status == 200 and body["is_sleeping"] is True, body
    status, done = _complete(a, model)
    assert status == 200 and done["usage"]["completion_tokens"] == 4, done
    _until("awake on the other replica", lambda: not is_sleeping(b, model))
    for url in (a, b):
        status, body = call_json(url, "GET", "/is_sleeping?model=no-such-model")
        assert status == 404 and body["error"]["code"] == "model_not_found"


def _roles(url: str) -> dict[str, Any]:
    status, stats = call_json(url, "GET", "/v1/aegaeon/stats?light=1")
    assert status == 200, stats
    return dict(stats["roles"])


def _role_gauges(url: str) -> dict[tuple[str, str], float]:
    return {(dict(labels)["instance"], dict(labels)["role"]): value
            for (name, labels), value in metric_samples(f"{url}/metrics").items()
            if name == "aegaeon_instance_role"}  # fmt: skip


def test_roles_move_on_a_burst_and_every_replica_dispatches_by_them(
    cluster: Served, model: str
) -> None:
    a, b = cluster.urls
    _until("both replicas see both nodes", lambda: all(_both_nodes_up(u) for u in (a, b)))

    async def burst() -> list[tuple[int, str | None]]:
        firsts: dict[str, int] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            body = {"model": model, "prompt": "a burst " * 40, "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            return list(await asyncio.gather(*(
                stream_completion(session, f"{(a, b)[k % 2]}/v1", body, firsts, f"r{k}")
                for k in range(BURST))))  # fmt: skip

    results = asyncio.run(burst())
    assert all(r == (200, "length") for r in results), results

    def moved() -> tuple[dict[str, Any], dict[str, Any]] | None:
        ra, rb = _roles(a), _roles(b)
        converted = [i for i, r in ra["roles"].items()
                     if i.endswith("/decode-0") and r == "prefill"]  # fmt: skip
        return (ra, rb) if converted and ra["roles"] == rb["roles"] else None

    ra, rb = _until("a decode instance in the prefill role, the same on both replicas", moved)
    assert ra["enabled"] is True and ra["decider"] == rb["decider"] != ""
    assert [ra["deciding"], rb["deciding"]].count(True) == 1, (ra, rb)
    assert any(c["role"] == "prefill" and c["instance"].endswith("/decode-0")
               for c in rb["changes"]), rb  # fmt: skip
    assert set(ra["base_roles"]) == set(ra["roles"]) and len(ra["roles"]) == 4, ra

    def agreed() -> dict[str, str] | None:
        """The roles, when both replicas' health and metrics say them (they may still
        move: the other decode instance may convert too)."""
        roles = dict(_roles(a)["roles"])
        for url in (a, b):
            gauges = _role_gauges(url)
            status, health = call_json(url, "GET", "/health")
            assert status == 200, health
            said = {i: h["role"] for i, h in health["backend"]["instances"].items()}
            if said != roles or any(gauges.get((i, r)) != 1.0 for i, r in roles.items()):
                return None
        return roles

    _until("both replicas' health and metrics say the decided roles", agreed)
    # dispatch goes by them: requests through either replica still complete
    for url in (a, b):
        status, done = _complete(url, model)
        assert status == 200 and done["usage"]["completion_tokens"] == 4, done


def test_a_lora_adapter_loaded_on_one_replica_is_served_and_unloaded_through_the_other(
    cluster: Served, small_market: Path, market_names: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from aegaeon_market.adapters import add_random_adapter
    from lora_support import lora_market

    a, b = cluster.urls
    _until("both replicas see both nodes", lambda: all(_both_nodes_up(u) for u in (a, b)))
    base = market_names[0]
    # a random adapter of the served model, in a folder of its own (not the shared market)
    work = lora_market(tmp_path_factory.mktemp("multinode-lora") / "m",
                       {base: small_market / base})
    adapter = add_random_adapter(work, "tuned", base, 8).path
    status, text = post_text(a, "/v1/load_lora_adapter",
                             {"lora_name": "tuned", "lora_path": str(adapter)})
    assert status == 200 and "added successfully" in text, text
    _until("the other replica serves it", lambda: "tuned" in _listed(b))
    parents = {m["id"]: m["parent"] for m in call_json(b, "GET", "/v1/models")[1]["data"]}
    assert parents["tuned"] == base
    for url in (b, a, b):  # both replicas, so both nodes' instances take it
        status, done = _complete(url, "tuned")
        assert status == 200 and done["usage"]["completion_tokens"] == 4, done
    status, text = post_text(b, "/v1/load_lora_adapter",
                             {"lora_name": "broken", "lora_path": str(work / base)})
    assert status == 400 and "adapter_config.json" in text, text
    status, text = post_text(b, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert status == 200 and "removed successfully" in text, text
    assert _complete(b, "tuned")[0] == 404
    _until("the first replica no longer serves it", lambda: _complete(a, "tuned")[0] == 404)
    status, text = post_text(a, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert status == 404, text
    assert _complete(a, base)[0] == 200  # its base is served as before

