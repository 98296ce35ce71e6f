"""SLO classes through `aegaeon serve` (issue 19, past the paper), on the shared node
(fixed roles, SLO classes on: the default config): an interactive request overtakes
batch requests queued before it, a priority that is not a class is a 400. Behaviour
only: no timing is asserted. Role switching: test_serve_roles."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aegaeon_bench.node.probe import wait_quiet
from http_support import call_json
from serve_harness import Served, prompt_body, stream_completion

BATCH = 24  # batch requests queued ahead of the interactive one
REQUEST_TIMEOUT_S = 600.0  # a busy 2-core CI machine


@pytest.fixture(scope="module")
def model(market_names: list[str]) -> str:
    return market_names[0]


@pytest.fixture
def classes(served: Served) -> Served:
    """The shared node: fixed roles, SLO classes on (the default), one prefill and one
    decode instance."""
    return served


def test_a_priority_that_is_not_a_class_is_a_400(classes: Served, model: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "priority": "urgent"}
    status, answer = call_json(classes.base_url, "POST", "/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "priority" and error["type"] == "invalid_request_error"


def test_an_interactive_request_overtakes_queued_batch_ones(classes: Served, model: str) -> None:
    async def main() -> tuple[list[tuple[int, str | None]], dict[str, int], int, Any]:
        firsts: dict[str, int] = {}  # each stream's place among the first tokens
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            url = classes.base_url
            batch = [asyncio.ensure_future(
                stream_completion(session, url, prompt_body(model, k, "batch"), firsts, f"b{k}"))
                for k in range(BATCH)]  # fmt: skip
            # the interactive request once every batch request is queued at the proxy
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while time.monotonic() < deadline:
                async with session.get(f"{classes.url}/v1/aegaeon/stats?light=1") as resp:
                    if (await resp.json())["open_requests"] >= BATCH:
                        break
                await asyncio.sleep(0.02)
            sent = len(firsts)  # first tokens before the interactive request was sent
            urgent = await stream_completion(session, url, prompt_body(model, 999, "interactive"),
                                             firsts, "i")  # fmt: skip
            results = [*await asyncio.gather(*batch), urgent]
            held = await wait_quiet(session, classes.url, 60.0)
            return results, firsts, sent, held

    results, firsts, sent, held = asyncio.run(main())
    assert all(r == (200, "length") for r in results), results
    assert held.quiet, held.to_dict()
    pending = [name for name, k in firsts.items() if name != "i" and k >= sent]
    # FIFO would prefill every batch request queued before it first; by deadline the
    # interactive one goes ahead of all but the prefills already running
    assert len(pending) >= 4, f"the batch backlog drained before the interactive arrived: {firsts}"
    overtaken = [name for name in pending if firsts[name] > firsts["i"]]
    assert len(overtaken) >= len(pending) // 2, (len(overtaken), len(pending))
