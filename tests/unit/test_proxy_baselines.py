"""A request-level baseline over the store (``cluster.placement.Baselines``), one node: the
policy's picture lives in the store's ``baseline`` record; an arrival runs on a free
instance or waits bound to one, a request's end starts what waited, a cancel reaches
its instance, static multiplexing refuses a model it placed nowhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import zmq.asyncio
from aegaeon_common.config import Config, config_from_dict
from aegaeon_common.messages.decode import DECODE_CHANNEL, RunRequest
from aegaeon_common.messages.prefill import CancelRequest
from aegaeon_common.messages.report import (
    InstanceHello,
    PrefillDone,
    StepTokens,
    TokenItem,
)
from aegaeon_common.messages.structs import RequestTimings, SamplingParams
from aegaeon_common.registry import BASELINE, decode_baseline
from aegaeon_common.transport import Puller
from aegaeon_common.wire import Message
from aegaeon_proxy.backend import GenerationRequest
from aegaeon_proxy.cluster.backend import ClusterBackend
from fake_worker import latency_profile

MODELS = ("a", "b")


def _config(tmp_path: Path, policy: str) -> Config:
    return config_from_dict({
        "models": [{"name": m, "path": f"/nonexistent/{m}"} for m in MODELS],
        "run_dir": str(tmp_path), "scheduler": {"policy": policy, "max_batch_size": 1},
        "prefill": {"instances": 1}, "decode": {"instances": 1},
    })  # fmt: skip


async def _next_run(pull: Puller) -> Message:
    while True:
        msg = await asyncio.wait_for(pull.recv(), 5.0)
        if isinstance(msg, RunRequest | CancelRequest):
            return msg


@asynccontextmanager
async def _node(config: Config) -> AsyncIterator[tuple[ClusterBackend, list[Puller]]]:
    """A backend over two unified instances (their command sockets: the pullers),
    stopped on the way out."""
    ctx = zmq.asyncio.Context()
    pulls = [Puller(ctx, config.decode_address(i), DECODE_CHANNEL) for i in range(2)]
    backend = ClusterBackend(config)
    profile = latency_profile(MODELS)
    for i in range(2):  # two unified instances: decode-0, decode-1
        backend.local.on_hello(InstanceHello("decode", i, 10 + i, 1 << 20, 1 << 20, 8,
                                             dict.fromkeys(MODELS, 4096), profile,
                                             incarnation=1 + i))  # fmt: skip
    await asyncio.sleep(0.05)  # (the records written)
    await backend.view.refresh()
    backend._store_ok = backend._checked = True
    try:
        yield backend, pulls
    finally:
        await backend.stop()
        for pull in pulls:
            pull.close()
        ctx.destroy(linger=0)


def _gen(rid: str, model: str) -> GenerationRequest:
    return GenerationRequest(rid, model, tuple(range(8)), SamplingParams(max_tokens=4), 0.0)


async def test_a_request_level_baseline_binds_runs_and_releases_through_the_store(
    tmp_path: Path,
) -> None:
    async with _node(_config(tmp_path, "request-level")) as (backend, pulls):
        assert backend.ready() and backend.local.expected == ("decode-0", "decode-1")
        streams = {rid: backend.submit(_gen(rid, m)) for rid, m in
                   (("r0", "a"), ("r1", "b"), ("r2", "a"))}  # fmt: skip
        runs = [await _next_run(pulls[0]), await _next_run(pulls[1])]
        assert sorted((type(m).__name__, getattr(m, "request_id", "")) for m in runs) == [
            ("RunRequest", "r0"), ("RunRequest", "r1")]  # fmt: skip
        state = decode_baseline(await backend.store.get(BASELINE))
        assert state["policy"] == "request-level"
        assert any(q and q[0][0] == "r2" for q in state["pinned"].values())  # r2 waits, bound
        # r0 ends: the instance it ran on takes r2 (same model) at once
        on = next(i for i, m in enumerate(runs) if getattr(m, "request_id", "") == "r0")
        backend._on_prefill_done(PrefillDone("r0", on, 7, None, None, RequestTimings(), 0.0,
                                             kind="decode"))  # fmt: skip
        backend.table.step_tokens(StepTokens(on, [TokenItem("r0", [1, 2, 3], "length")], 0.0))
        nxt = await _next_run(pulls[on])
        assert isinstance(nxt, RunRequest) and nxt.request_id == "r2" and nxt.incarnation == 1 + on
        assert streams["r0"].finished
        # r1 cancelled: the cancel reaches its instance; nothing is bound to it any more
        await backend.cancel("r1")
        cancel = await _next_run(pulls[1 - on])
        assert isinstance(cancel, CancelRequest) and cancel.request_id == "r1"
        await asyncio.sleep(0.05)
        state = decode_baseline(await backend.store.get(BASELINE))
        running = {n: [r[0] for r in v[1]] for n, v in state["instances"].items()}
        assert running == {f"decode-{on}": ["r2"], f"decode-{1 - on}": []}


async def test_static_multiplexing_refuses_a_model_it_placed_nowhere(tmp_path: Path) -> None:
    async with _node(_config(tmp_path, "static-mux")) as (backend, pulls):
        stream = backend.submit(_gen("r0", "a"))
        for _ in range(100):
            if backend.requests["r0"].where is not None:
                break
            await asyncio.sleep(0.01)
        where = backend.requests["r0"].where
        assert where is not None
        on = where.instance
        run = await _next_run(pulls[int(on.rpartition("-")[2])])
        assert isinstance(run, RunRequest) and run.request_id == "r0"
        refused = backend.submit(_gen("r1", "zzz"))  # not a model of the placement
        await asyncio.sleep(0.05)
        assert refused.finished and not stream.finished
