"""Role switching through `aegaeon serve` (issue 19, past the paper): with
``roles.enabled`` (low thresholds) a burst of prefill work turns the decode instance
to the prefill role, every request completes and the node holds nothing afterwards.
Behaviour only: no timing is asserted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aegaeon_bench.node.probe import wait_quiet
from http_support import Samples, metric_samples
from serve_harness import (
    Served,
    prompt_body,
    serve_config,
    serving,
    stream_completion,
)

WAVES = (48, 16)  # the role-switch burst: a backlog on the prefill instance, then more
REQUEST_TIMEOUT_S = 600.0  # a busy 2-core CI machine


@pytest.fixture(scope="module")
def model(market_names: list[str]) -> str:
    return market_names[0]


@pytest.fixture(scope="module")
def moving(small_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Roles move by token velocity, with thresholds any burst crosses."""
    # ... and, once turned, it stays for the test (no turning back on decode pressure)
    roles = {"enabled": True, "high_util": 0.001, "low_util": 0.0005, "up_hold": 0.0,
             "down_hold": 600.0, "min_dwell": 0.5, "decode_high": 1e9,
             "convert_max_demand": 1.0}  # fmt: skip
    # no admission bound in the way: every request of the burst is queued at once
    proxy = {"max_prefill_tokens": 100_000_000}
    config = serve_config(small_market, roles=roles, proxy=proxy)
    with serving(small_market, tmp_path_factory.mktemp("roles") / "run",
                 config=config) as served:  # fmt: skip
        yield served


def _metrics(served: Served) -> Samples:
    return metric_samples(f"{served.url}/metrics")


def test_a_burst_turns_the_decode_instance_to_prefill_and_nothing_is_lost(
    moving: Served, model: str
) -> None:
    async def role_of(session: aiohttp.ClientSession, name: str) -> str:
        async with session.get(f"{moving.url}/v1/aegaeon/stats?light=1") as resp:
            stats = await resp.json()
        return str(next(i["role"] for i in stats["instances"] if i["name"] == name))

    async def main() -> tuple[list[tuple[int, str | None]], Any, dict[str, Any]]:
        firsts: dict[str, int] = {}
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            assert await role_of(session, "decode-0") == "decode"

            def wave(first: int, n: int) -> list[asyncio.Future[tuple[int, str | None]]]:
                return [asyncio.ensure_future(stream_completion(
                    session, moving.base_url, prompt_body(model, k, "standard", 8), firsts,
                    f"r{k}")) for k in range(first, first + n)]  # fmt: skip

            # The first wave queues on the prefill instance; the demand turns the decode
            # instance to prefill; the second wave, arriving behind that backlog, is
            # prefilled there (new groups go to the least loaded prefill queue).
            pending = wave(0, WAVES[0])
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while await role_of(session, "decode-0") != "prefill":
                assert time.monotonic() < deadline, "decode-0 never took the prefill role"
                await asyncio.sleep(0.02)
            pending += wave(WAVES[0], WAVES[1])
            results = list(await asyncio.gather(*pending))
            held = await wait_quiet(session, moving.url, 60.0)
            async with session.get(f"{moving.url}/v1/aegaeon/stats") as resp:
                stats = await resp.json()
            return results, held, stats

    results, held, stats = asyncio.run(main())
    assert all(r == (200, "length") for r in results), results
    roles = stats["roles"]
    assert roles["enabled"] is True and roles["switches"].get("prefill", 0) >= 1, roles
    assert any(c["instance"] == "decode-0" and c["role"] == "prefill" for c in roles["changes"])
    # Whether the converted instance prefills part of the second wave depends on
    # where the first wave stands when it arrives (on a loaded machine it was seen
    # to take none): not asserted; placement is the dispatcher's unit tests'.
    assert held.quiet, held.to_dict()  # no request, sequence, KV block or lease left
    assert stats["counters"]["failed"] == 0
    metrics = _metrics(moving)
    assert metrics[("aegaeon_role_switches_total", (("role", "prefill"),))] >= 1
    assert ("aegaeon_instance_role", (("instance", "decode-0"), ("role", "prefill"))) in metrics
    assert any(name == "aegaeon_cluster_velocity_tokens_per_second" for name, _ in metrics)
