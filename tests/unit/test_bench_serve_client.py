"""`bench serve`'s open-loop run against a fake proxy: streams, errors, stalls, the deadline."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aegaeon_bench.serve.run import RunOptions, RunOutcome, run_load
from aegaeon_workload.plan import PlannedRequest
from aiohttp import web

STALL_S = 30.0  # longer than any test: the run's deadline must cut it


def _event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _chunk(text: str | None, finish: str | None = None, usage: int | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    body: dict[str, Any] = {"id": "cmpl-fake", "choices": choices, "usage": None}
    if usage is not None:
        body["usage"] = {"completion_tokens": usage}
    return _event(body)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model, n = body["model"], body["max_tokens"]
    assert body["ignore_eos"] is True and body["stream"] is True
    assert isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"])
    if model == "refused":
        return web.json_response({"error": {"message": "no"}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if model == "stuck":
        await resp.write(_chunk("x"))
        await asyncio.sleep(STALL_S)
    if model == "broken":
        await resp.write(_event({"error": {"message": "generation failed"}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if model == "split":  # the same stream cut anywhere: events across and within reads
        data = b"".join(_chunk(f"t{k}") for k in range(n - 1))
        data += _chunk("", finish="length") + _chunk(None, usage=n) + b"data: [DONE]\n\n"
        for i in range(0, len(data), 7):
            await resp.write(data[i : i + 7])
            await asyncio.sleep(0.002)
        return resp
    for k in range(n - 1):  # the last token's text is held back, as a detokenizer may
        await resp.write(_chunk(f"t{k}"))
        await asyncio.sleep(0.01)
    await resp.write(_chunk("", finish="length"))
    await resp.write(_chunk(None, usage=n))
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _stats_handler() -> Any:
    calls = 0

    async def stats(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        kv = {"fragmentation": 0.1, "held_bytes": 1, "shapes": []}
        return web.json_response({"instances": {"decode-0": {"counters": {
            "switches": float(calls)}}}, "cache": {"kv": kv}})  # fmt: skip

    return stats


def _planned(model: str, offset_s: float, n: int = 4) -> PlannedRequest:
    return PlannedRequest(f"{model}/{offset_s}", model, offset_s, 8, n, 100, seed=0)


async def _run(planned: list[PlannedRequest], options: dict[str, Any],
               middlewares: tuple[Any, ...] = ()) -> RunOutcome:
    """``run_load`` against the fake proxy (behind ``middlewares``) on a port of its own."""
    app = web.Application(middlewares=middlewares)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/aegaeon/stats", _stats_handler())
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await run_load(planned, RunOptions(f"http://127.0.0.1:{port}", **options))
    finally:
        await runner.cleanup()


def test_open_loop_run_records_every_outcome() -> None:
    planned = [_planned("stuck", 0.0), _planned("split", 0.05, n=6), _planned("good", 0.1, n=5),
               _planned("refused", 0.2), _planned("broken", 0.25),
               _planned("good", 0.3, n=1)]  # fmt: skip
    opts = {"duration_s": 0.4, "grace_s": 0.6, "sample_interval_s": 0.1}
    outcome = asyncio.run(_run(planned, opts))
    records = {r.request_id: r for r in outcome.records()}
    start = outcome.start_s
    # open loop: each arrival is its planned time, whatever the stuck request before it
    # does: every request left before the stuck one was given up (a closed loop would
    # have waited for it), however late a busy machine made the send
    given_up_s = start + opts["duration_s"] + opts["grace_s"]
    for p in planned:
        assert records[p.request_id].arrival_s == start + p.offset_s
        assert start + p.offset_s - 0.01 <= (records[p.request_id].sent_s or 0) < given_up_s
    good = records["good/0.1"]
    assert good.status == "ok" and good.error is None and good.server_id == "cmpl-fake"
    assert good.num_events == 4 and len(good.token_times_s) == 5  # 5 tokens in 4 events
    assert good.token_times_s[-1] >= good.token_times_s[-2]  # the held token: at the finish
    assert records["good/0.3"].status == "ok" and len(records["good/0.3"].token_times_s) == 1
    split = records["split/0.05"]
    assert split.status == "ok" and split.num_events == 5 and len(split.token_times_s) == 6
    stuck = records["stuck/0.0"]
    assert stuck.status == "failed" and "unfinished" in (stuck.error or "")
    assert len(stuck.token_times_s) == 1  # what came before the deadline still counts
    assert outcome.end_s - start < 0.4 + 0.6 + 10.0  # ends at the grace, not later
    refused = records["refused/0.2"]
    assert refused.status == "failed" and "HTTP 400" in (refused.error or "")
    assert "generation failed" in (records["broken/0.25"].error or "")
    assert outcome.stats_before is not None and outcome.stats_after is not None
    assert len(outcome.kv_samples) >= 3


def test_a_user_key_runs_the_load_and_the_stats_it_may_not_read_are_left_out() -> None:
    """A node with keys (issue 43): the key goes with every request; the stats need an
    admin key (issue 45), so a user key's run has none and still completes."""
    key = "sk-user-key-1234"

    @web.middleware
    async def keys(request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        if given != f"Bearer {key}":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        if request.path.startswith("/v1/aegaeon/"):
            return web.json_response({"error": {"code": "insufficient_permissions"}},
                                     status=403)  # fmt: skip
        return await handler(request)

    def run(api_key: str | None) -> RunOutcome:
        options = {"duration_s": 0.2, "grace_s": 5.0, "sample_interval_s": 0.05,
                   "api_key": api_key}
        return asyncio.run(_run([_planned("good", 0.0), _planned("good", 0.1)], options,
                                (keys,)))

    with_key = run(key)
    assert all(r.status == "ok" for r in with_key.records())
    assert with_key.stats_before is None and with_key.stats_after is None
    assert with_key.kv_samples == []
    without = run(None)
    errors = [r.error or "" for r in without.records()]
    assert all("HTTP 401 (the node wants an API key: --api-key KEY" in e for e in errors), errors
