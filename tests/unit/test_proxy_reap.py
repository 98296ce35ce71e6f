"""A replica reaps a dead one: every request of it is cancelled where it may run and
taken out of every shared queue, even where its metadata was not rewritten yet."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import zmq.asyncio
from aegaeon_common.config import config_from_dict
from aegaeon_common.messages.prefill import PREFILL_CHANNEL, CancelRequest
from aegaeon_common.registry import (
    PROXIES,
    RequestMeta,
    encode,
    prefill_queue_key,
    proxy_requests_key,
    request_key,
    work_list_key,
)
from aegaeon_common.transport import Puller
from aegaeon_proxy.cluster.backend import ClusterBackend
from aegaeon_sched import DecodeWorkList, PrefillQueue, Request
from aegaeon_sched.shared import queue_of, queued_request_ids
from proxy_support import instance_record, put_records


def _queue(group_id: int, *rids: str, prefill: bool) -> PrefillQueue | DecodeWorkList:
    queue = PrefillQueue() if prefill else DecodeWorkList()
    for rid in rids:
        queue.add(Request(rid, "m", 0.0, 8, 16), group_id)
    return queue


def _meta(rid: str, proxy: str, instance: str, queue: str, state: str = "queued") -> bytes:
    meta = RequestMeta(v=1, request_id=rid, model="m", proxy=proxy, instance=instance,
                       state=state, tokens_sent=0, arrival_s=0.0, queue=queue)  # fmt: skip
    return encode(meta)


def test_queued_request_ids_reads_both_kinds_of_queue() -> None:
    prefill = _queue(7, "run", "wait", prefill=True)
    assert isinstance(prefill, PrefillQueue)
    prefill.start("run", 0.0)
    assert queued_request_ids(prefill) == {"run", "wait"}
    assert queued_request_ids(_queue(3, "x", "y", prefill=False)) == {"x", "y"}
    assert queued_request_ids(queue_of(None, prefill=True)) == set()


async def test_a_dead_replicas_requests_leave_every_queue_even_with_stale_metadata(
    tmp_path: Path,
) -> None:
    ctx = zmq.asyncio.Context()
    pulls = {k: Puller(ctx, "tcp://127.0.0.1:0", PREFILL_CHANNEL) for k in ("prefill", "decode")}
    backend = ClusterBackend(config_from_dict({"models": [{"name": "m", "path": "x"}],
                                                   "run_dir": str(tmp_path)}))  # fmt: skip
    store = backend.store
    try:
        await put_records(store, *(instance_record("a", kind, address=pull.bound_address)
                                   for kind, pull in pulls.items()))  # fmt: skip
        await backend.view.refresh()
        pq, dw = prefill_queue_key("a/prefill-0", 1), work_list_key("a/decode-0", 1)
        # "placed": its placement committed, its metadata still names the prefill queue;
        # "dispatched": queued, no metadata written yet; "decoding": metadata up to date;
        # "alive": another replica's request, left alone
        await store.put(pq, msgspec.msgpack.encode(_queue(1, "dispatched", "alive",
                                                          prefill=True)))  # fmt: skip
        await store.put(dw, msgspec.msgpack.encode(_queue(5, "placed", "decoding",
                                                          prefill=False)))  # fmt: skip
        await store.put(request_key("placed"), _meta("placed", "dead", "a/prefill-0", pq))
        await store.put(request_key("decoding"), _meta("decoding", "dead", "a/decode-0", dw,
                                                         "decoding"))
        await store.set_add(proxy_requests_key("dead"), "placed", "dispatched", "decoding")
        await store.set_add(PROXIES, "dead")

        await backend._reap("dead")

        assert queued_request_ids(queue_of(await store.get(pq), True)) == {"alive"}
        assert queued_request_ids(queue_of(await store.get(dw), False)) == set()
        assert "dead" not in await store.set_members(PROXIES)
        assert not await store.set_members(proxy_requests_key("dead"))
        got: dict[str, set[tuple[str, bool]]] = {}
        for kind, pull in pulls.items():
            while True:
                try:
                    msg = await asyncio.wait_for(pull.recv(), 1.0)
                except TimeoutError:
                    break
                assert isinstance(msg, CancelRequest)
                got.setdefault(kind, set()).add((msg.request_id, msg.free_handoff))
        # the handoff is freed where it was prefilled, never where it is decoded
        assert got == {"prefill": {("placed", True), ("dispatched", True)},
                       "decode": {("placed", False), ("decoding", False)}}  # fmt: skip
    finally:
        for pull in pulls.values():
            pull.close()
        await backend.stop()
        ctx.destroy(linger=0)
