"""Who may call what: every route of the proxy against every kind of key (issue 45).

:data:`TABLE` has one row per endpoint and one column per key kind: no key, a
user key, a user key limited to one model (:data:`MINE`), an admin key. Each
row runs for each kind on a fresh proxy over a test double that records what
it is asked, with keys on the API port, with keys and ``proxy.admin_port`` (the
admin routes there), and with no keys (every kind then gets the admin key's
answer, as a local node always did). A refusal is OpenAI's error shape, names
no model the path or body held, and leaves the double untouched. Every route
the app declares must have a row (a new route without one fails
:func:`test_the_table_covers_every_declared_route`). The tenant sequence of the
issue: a model-limited key's administrative calls are all 403 and the node is
unchanged. The live node (one node, and two nodes behind two replicas) is
checked in tests/e2e/test_serve_key_rights.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aegaeon_common.config import ApiKeyConfig, Config, ModelConfig, ProxyConfig
from aegaeon_proxy.app import ACCESS, make_admin_app
from aegaeon_proxy.auth import Access
from aegaeon_proxy.backend import ModelOps
from aegaeon_proxy.state import STATE
from aiohttp.test_utils import TestClient, TestServer
from key_rights import (
    ADMIN_KEY,
    COMPLETION,
    EXTRA,
    HEADERS,
    KINDS,
    LIMITED_KEY,
    MINE,
    OTHER,
    TABLE,
    USER_KEY,
    Row,
)
from proxy_support import ScriptedBackend, front, market_dir

KEYS = (ApiKeyConfig(USER_KEY), ApiKeyConfig(LIMITED_KEY, models=(MINE,)))
ADMIN_KEYS = (ApiKeyConfig(ADMIN_KEY),)
# (name, keys, admin port): where the rows run
SETUPS = {
    "keys": (KEYS, ADMIN_KEYS, None),
    "keys+admin_port": (KEYS, ADMIN_KEYS, 0),
    "no keys": ((), (), None),
}


class Recorder(ScriptedBackend, ModelOps):
    """Models on a pretend device and a Model Cache (model changes, sleep and wake,
    quarantine, stats): records every change the proxy asks for."""

    changes_models = True

    def __init__(self) -> None:
        super().__init__()
        self.models = self  # (its own model operations)
        self.token_ids = [5, 6]
        self.changes: list[tuple[Any, ...]] = []
        self.resident = {MINE, OTHER}

    async def add_model(self, model: ModelConfig) -> None:
        self.changes.append(("add", model.name))

    async def forget_model(self, name: str) -> bool:
        self.changes.append(("forget", name))
        return False

    async def set_model_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        self.changes.append(("flags", name, pinned, preload))

    async def model_cache(self) -> dict[str, Any] | None:
        return None

    def follow_unavailable(self, apply: Any) -> None:
        pass

    async def quarantine_model(self, name: str, why: str | None) -> None:
        self.changes.append(("quarantine", name, why))

    async def reload_model(self, model: ModelConfig) -> None:
        self.changes.append(("reload", model.name))

    async def set_model_awake(self, name: str, awake: bool) -> bool:
        self.changes.append(("awake", name, awake))
        (self.resident.add if awake else self.resident.discard)(name)
        return self.model_sleeping(name)

    def model_sleeping(self, name: str) -> bool:
        return name not in self.resident

    async def stats(self, light: bool = False) -> dict[str, Any]:
        return {"instances": [], "open_requests": 0}


class Node:
    """A proxy over a :class:`Recorder`: its API port and, with ``admin_port``, its admin port."""

    def __init__(self, public: TestClient[Any, Any], admin: TestClient[Any, Any] | None,
                 backend: Recorder, app: Any) -> None:  # fmt: skip
        self.public, self.admin, self.backend, self.app = public, admin, backend, app

    def client(self, route: str, method: str) -> TestClient[Any, Any]:
        admin_routes = {(m, p) for m, p, _ in ACCESS[Access.ADMIN]}
        if self.admin is not None and (method, route) in admin_routes:
            return self.admin
        return self.public

    def served(self) -> dict[str, tuple[str, bool]]:
        """Each model the proxy knows: its state and whether it is pinned."""
        models = self.app[STATE].models
        return {n: (models.get(n).state, models.settings(n).pin) for n in models.names()}


def _config(setup: str) -> Config:
    keys, admin_keys, admin_port = SETUPS[setup]
    market = market_dir()
    return Config(models=(ModelConfig(MINE, market / MINE), ModelConfig(OTHER, market / OTHER)),
                  market_dir=market, proxy=ProxyConfig(api_keys=keys, admin_keys=admin_keys,
                                                       admin_port=admin_port))  # fmt: skip


@pytest.fixture
async def node(setup: str) -> AsyncIterator[Node]:
    """A fresh proxy of ``setup`` over a :class:`Recorder`."""
    backend = Recorder()
    assert backend.changes_models
    config = _config(setup)
    async with front(config, backend) as public:
        if config.proxy.admin_port is None:
            yield Node(public, None, backend, public.app)
            return
        async with TestClient(TestServer(make_admin_app(public.app[STATE]))) as admin:
            yield Node(public, admin, backend, public.app)


def _cases() -> Iterator[Any]:
    for setup in SETUPS:
        for row in TABLE:
            for k, kind in enumerate(KINDS):
                # no keys: every caller is answered as the admin key is
                want = row.want[k] if setup != "no keys" else row.want[KINDS.index("admin")]
                yield pytest.param(setup, row, kind, want,
                                   id=f"{setup}:{row.method} {row.path}:{kind}")  # fmt: skip


@pytest.mark.parametrize(("setup", "row", "kind", "want"), list(_cases()))
async def test_each_endpoint_answers_each_kind_of_key(node: Node, row: Row, kind: str,
                                                      want: int) -> None:  # fmt: skip
    before = node.served()
    client = node.client(row.route, row.method)
    resp = await client.request(row.method, row.path, json=row.body, headers=HEADERS[kind])
    assert resp.status == want, (await resp.read())[:300]
    if want < 400:
        return
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    code = {400: "invalid_value", 401: "invalid_api_key", 403: "insufficient_permissions",
            404: "model_not_found"}[want]  # fmt: skip
    assert body["error"]["code"] == code, body
    if want == 401:
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    if want == 403:
        message = body["error"]["message"]
        assert "'admin' right" in message and row.route in message, message
        for name in (MINE, OTHER, EXTRA, "no-such-model"):
            assert name not in message, message  # the key learns no model's name
    if want in (401, 403):  # refused before anything was done
        assert node.backend.changes == [] and node.backend.submitted == []
        assert node.served() == before


def test_the_table_covers_every_declared_route() -> None:
    declared = {(m, p, access) for access, routes in ACCESS.items() for m, p, _ in routes}
    rows = {(r.method, r.route) for r in TABLE}
    missing = {(m, p) for m, p, _ in declared} - rows
    assert not missing, f"routes with no row in TABLE: {sorted(missing)}"
    assert rows <= {(m, p) for m, p, _ in declared}, "a row names no declared route"
    # and each row's key columns are its route's access rule
    rule = {Access.OPEN: (200, 200), Access.USER: (401, 200), Access.ADMIN: (401, 403)}
    for method, path, access in declared:
        for row in (r for r in TABLE if (r.method, r.route) == (method, path)):
            assert (row.want[0], row.want[1]) == rule[access], row
            assert (access is Access.ADMIN) == (row.want[2] == 403), row


@pytest.mark.parametrize("setup", ["keys", "keys+admin_port"])
async def test_the_tenant_sequence_is_refused_and_leaves_the_node_as_it_was(node: Node) -> None:
    """Issue 45's sequence with a key limited to one model: every administrative call
    is a 403, and the other model is still served, not pinned, not asleep."""
    tenant = HEADERS["limited"]
    admin, api = node.client("/metrics", "GET"), node.public
    before = node.served()
    calls = [("PATCH", f"/v1/aegaeon/models/{OTHER}", {"pinned": True}),
             ("DELETE", f"/v1/aegaeon/models/{OTHER}", None),
             ("POST", f"/sleep?model={OTHER}", None),
             ("GET", "/v1/aegaeon/stats", None),
             ("GET", "/metrics", None)]  # fmt: skip
    for method, path, body in calls:
        resp = await admin.request(method, path, json=body, headers=tenant)
        assert resp.status == 403, (method, path, await resp.read())
    assert node.backend.changes == []
    assert node.served() == before == {MINE: ("serving", False), OTHER: ("serving", False)}
    listed = await (await api.get("/v1/models", headers=tenant)).json()
    assert [m["id"] for m in listed["data"]] == [MINE]  # its own model only
    listed = await (await api.get("/v1/models", headers=HEADERS["user"])).json()
    assert sorted(m["id"] for m in listed["data"]) == sorted([MINE, OTHER])
    resp = await api.post("/v1/completions", headers=HEADERS["user"],
                          json={"model": OTHER, **COMPLETION})  # fmt: skip
    assert resp.status == 200  # still served
    asleep = await (await admin.get(f"/is_sleeping?model={OTHER}",
                                    headers=HEADERS["admin"])).json()  # fmt: skip
    assert asleep["is_sleeping"] is False
    row = await (await admin.get(f"/v1/aegaeon/models/{OTHER}",
                                 headers=HEADERS["admin"])).json()  # fmt: skip
    assert row["state"] == "serving" and row["pinned"] is False


@pytest.mark.parametrize("setup", ["keys"])
async def test_an_admin_key_administers(node: Node) -> None:
    """The admin key's own calls do what they say (the rows' 2xx are real changes)."""
    admin = HEADERS["admin"]
    resp = await node.public.patch(f"/v1/aegaeon/models/{OTHER}", json={"pinned": True},
                                   headers=admin)  # fmt: skip
    assert resp.status == 200 and (await resp.json())["pinned"] is True
    assert (await node.public.post(f"/sleep?model={MINE}", headers=admin)).status == 200
    assert node.backend.changes == [("flags", OTHER, True, False), ("awake", MINE, False)]
