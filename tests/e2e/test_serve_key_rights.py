"""Issue 45 on live nodes: who may call what, on one node and on ``--nodes 2 --proxies 2``.

The table of tests/key_rights.py (every endpoint x no key, user key, user key
limited to one model, admin key) against ``aegaeon serve`` with keys and the
admin endpoints on the API port (no ``proxy.admin_port``): the one node takes
its keys from its config file (``proxy.api_keys``, ``proxy.admin_keys``), the
two nodes from the command line (``--api-key KEY:MODEL``, ``--admin-key``),
where every replica must enforce them alike and none may reach the store. The
refusals run on every replica, then the admin key's calls (which change the
node) once each, in turn on the replicas. The tenant sequence of the issue
leaves the model served, not pinned and not asleep. The proxy app's own test
(tests/unit/test_proxy_key_rights.py) runs the table with the admin port too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from http_support import call_json
from key_rights import (
    ADMIN_KEY,
    COMPLETION,
    HEADERS,
    KINDS,
    LIMITED_KEY,
    MINE,
    OTHER,
    TABLE,
    USER_KEY,
    Row,
)
from serve_harness import Served, is_sleeping, serve_config, serving, until

TOPOLOGIES = ("one node", "2 nodes, 2 proxies")
SETTLE_S = 120.0


@dataclass
class Live:
    served: Served
    urls: list[str]  # every proxy replica's API
    redis_url: str | None


@pytest.fixture(scope="module", params=TOPOLOGIES)
def live(request: pytest.FixtureRequest, small_market: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:  # fmt: skip
    models = [{"name": n, "path": str(small_market / n)} for n in (MINE, OTHER)]
    run_dir = tmp_path_factory.mktemp("key-rights") / "run"
    if request.param == "one node":
        proxy = {"api_keys": [USER_KEY, {"key": LIMITED_KEY, "models": [MINE]}],
                 "admin_keys": [ADMIN_KEY]}  # fmt: skip
        config = serve_config(small_market, models=models, proxy=proxy)
        with serving(small_market, run_dir, config=config) as served:
            yield Live(served, [served.url], None)
        return
    redis_url = request.getfixturevalue("redis_url")
    config = serve_config(small_market, models=models)
    with serving(small_market, run_dir, "--nodes", "2", "--proxies", "2", "--store-url",
                 redis_url, "--api-key", USER_KEY, "--api-key", f"{LIMITED_KEY}:{MINE}",
                 "--admin-key", ADMIN_KEY, config=config) as served:  # fmt: skip
        urls = served.urls

        def both_nodes_up() -> bool:
            stats = [call_json(u, "GET", "/v1/aegaeon/stats?light=1", headers=HEADERS["admin"])
                     for u in urls]  # fmt: skip
            return all(s == 200 and body.get("nodes") == ["node-0", "node-1"] for s, body in stats)

        until("both replicas see both nodes", both_nodes_up, SETTLE_S)
        yield Live(served, urls, redis_url)


def _check(row: Row, kind: str, status: int, body: Any) -> None:
    want = row.want[KINDS.index(kind)]
    assert status == want, (row, kind, status, str(body)[:300])
    if status == 403:
        assert body["error"]["code"] == "insufficient_permissions", body
        assert OTHER not in body["error"]["message"], body
    elif status == 401:
        assert body["error"]["code"] == "invalid_api_key", body


def _rows_state(url: str) -> dict[str, tuple[str, bool]]:
    status, body = call_json(url, "GET", "/v1/aegaeon/models", headers=HEADERS["admin"])
    assert status == 200, body
    return {m["name"]: (m["state"], m["pinned"]) for m in body["data"]}


def test_every_replica_refuses_what_a_key_may_not_call(live: Live) -> None:
    """The no-key, user-key and limited-key columns, on every replica: a refusal
    changes nothing."""
    before = _rows_state(live.urls[0])
    assert before == {MINE: ("serving", False), OTHER: ("serving", False)}
    for url in live.urls:
        for row in TABLE:
            for kind in ("none", "user", "limited"):
                status, body = call_json(url, row.method, row.path, row.body, HEADERS[kind])
                _check(row, kind, status, body)
    for url in live.urls:
        assert _rows_state(url) == before


def test_the_tenant_sequence_leaves_the_model_served_unpinned_and_awake(live: Live) -> None:
    """Issue 45's sequence with the model-limited key, on every replica."""
    user, tenant = HEADERS["user"], HEADERS["limited"]
    status, body = call_json(live.urls[0], "POST", "/v1/completions",
                         {"model": OTHER, **COMPLETION}, user)  # on a device now
    assert status == 200, body
    until(f"{OTHER} on a device",
          lambda: not is_sleeping(live.urls[-1], OTHER, HEADERS["admin"]), SETTLE_S)
    for url in live.urls:
        status, listed = call_json(url, "GET", "/v1/models", headers=tenant)
        assert status == 200 and [m["id"] for m in listed["data"]] == [MINE]
        for method, path, body in [("PATCH", f"/v1/aegaeon/models/{OTHER}", {"pinned": True}),
                                   ("DELETE", f"/v1/aegaeon/models/{OTHER}", None),
                                   ("POST", f"/sleep?model={OTHER}", None),
                                   ("GET", "/v1/aegaeon/stats", None),
                                   ("GET", "/metrics", None)]:  # fmt: skip
            status, answer = call_json(url, method, path, body, tenant)
            assert status == 403, (url, method, path, answer)
            assert answer["error"]["code"] == "insufficient_permissions"
    for url in live.urls:
        assert _rows_state(url)[OTHER] == ("serving", False)  # served, not pinned
        # a refused /sleep that went through would leave it asleep: no request wakes it
        # (a replica may read an instance's record a beat late under load: waited for)
        until(f"{OTHER} awake at {url}",
              lambda url=url: not is_sleeping(url, OTHER, HEADERS["admin"]), 30)
        status, body = call_json(url, "POST", "/v1/completions", {"model": OTHER, **COMPLETION},
                                 user)
        assert status == 200, body


def test_the_admin_key_may_call_everything(live: Live) -> None:
    """The admin column, each row once, the replicas in turn; the removal last (the
    rows before it act on the model it removes)."""
    rows = sorted(TABLE, key=lambda r: r.method == "DELETE")
    for i, row in enumerate(rows):
        url = live.urls[i % len(live.urls)]
        status, body = call_json(url, row.method, row.path, row.body, HEADERS["admin"])
        _check(row, "admin", status, body)


def test_no_key_reaches_the_store(live: Live) -> None:
    """The key table is configuration: nothing in Redis holds a key."""
    if live.redis_url is None:
        pytest.skip("one node: no store")
    import redis

    client = redis.Redis.from_url(live.redis_url)
    readers = {b"string": client.get, b"hash": client.hgetall, b"set": client.smembers,
               b"list": lambda k: client.lrange(k, 0, -1),
               b"zset": lambda k: client.zrange(k, 0, -1),
               b"stream": client.xrange}  # fmt: skip
    seen = 0
    for key in client.scan_iter(count=500):
        kind = client.type(key)
        value = repr(readers[kind](key)) if kind in readers else ""
        seen += 1
        for secret in (USER_KEY, LIMITED_KEY, ADMIN_KEY):
            assert secret not in repr(key) + value, key
    assert seen > 0  # the store holds the cluster's records
