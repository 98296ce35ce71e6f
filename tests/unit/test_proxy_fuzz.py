"""Property: whatever arrives at the two endpoints, the front never answers 5xx and every
error is in OpenAI's shape (hypothesis; a short run here, a long one in
`aegaeon bench fuzz`). The backend is the scripted one; the live node's run is in
tests/e2e/test_serve_hardened.py."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aegaeon_bench.reliability.fuzz_inputs import HttpCase, check_http, http_cases
from aegaeon_proxy.app import make_app
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from proxy_support import MODEL, ScriptedBackend, market_dir, scripted_config

EXAMPLES = int(os.environ.get("AEGAEON_FUZZ_EXAMPLES", "120"))


def test_both_endpoints_answer_any_body_without_5xx() -> None:
    config = scripted_config(market_dir(), max_body_bytes=64 << 10)
    backend = ScriptedBackend()
    backend.token_ids = [5, 6, 7]
    seen: dict[int, int] = {}
    with asyncio.Runner() as runner:
        async def start() -> TestClient[Any, Any]:
            client = TestClient(TestServer(make_app(config, backend)))
            await client.start_server()
            return client

        client = runner.run(start())

        async def one(case: HttpCase) -> list[str]:
            resp = await client.post(case.endpoint, data=case.body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
            body = await resp.read()
            seen[resp.status] = seen.get(resp.status, 0) + 1
            return check_http(case, resp.status, dict(resp.headers), body)

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(http_cases([MODEL, "no-such-model"]))
        def check(case: HttpCase) -> None:
            problems = runner.run(one(case))
            assert not problems, (case, problems)

        try:
            check()
            health = runner.run(client.get("/health"))
            assert health.status == 200
        finally:
            runner.run(client.close())
    assert not any(status >= 500 for status in seen), seen
    assert 200 in seen and 400 in seen  # the strategies reach both valid and invalid
