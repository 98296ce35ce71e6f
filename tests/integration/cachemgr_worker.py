"""A stand-in worker process for the cachemgr tests: ``python cachemgr_worker.py ROLE ADDRESS ID``.

Roles (one JSON line per step on stdout):
- ``producer CONSUMER_ID``: allocate blocks, hand them to CONSUMER_ID with an
  event, then write them piece by piece, the last piece (and the event's signal)
  only once a ``go`` line comes on stdin.
- ``consumer``: wait for a handoff line on stdin, say whether its event was
  complete already, wait on it, read and check the blocks, free them.
- ``holder MODEL``: allocate blocks and pin MODEL, then sleep until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
from aegaeon_common.messages.structs import KVShapeSpec
from aegaeon_gpumem import open_event
from aegaeon_runtime.cacheclient.client import CacheClient

SHAPE = KVShapeSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")
NUM_BLOCKS = 4
WRITE_STEPS = 10


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def pattern(index: int) -> int:
    return (index * 7 + 3) % 251 + 1  # never 0: a zero byte means "not written yet"


async def producer(client: CacheClient, consumer_id: str) -> None:
    reg = await client.register()
    timeline = reg.timeline(0)
    alloc = await client.alloc_blocks(SHAPE, NUM_BLOCKS)
    value = timeline.issue()
    event = {"kind": "cpu", "table": reg.event_table.name, "slot": timeline.slot, "value": value}
    await client.reassign_blocks(alloc.offsets, consumer_id)
    say(offsets=alloc.offsets, block_bytes=alloc.block_bytes, event=event)
    # A copy in pieces: each block gets its bytes in WRITE_STEPS pieces, the last one
    # when the test says (the consumer is waiting by then).
    step = alloc.block_bytes // WRITE_STEPS
    for k in range(WRITE_STEPS):
        if k == WRITE_STEPS - 1:
            assert (await asyncio.to_thread(sys.stdin.readline)).strip() == "go"
        for i, off in enumerate(alloc.offsets):
            end = alloc.block_bytes if k == WRITE_STEPS - 1 else (k + 1) * step
            reg.block(off, alloc.block_bytes)[k * step : end].fill_(pattern(i))
    timeline.signal(value)
    say(signaled=True)
    await client.close()


async def consumer(client: CacheClient) -> None:
    reg = await client.register()
    say(registered=True)
    handoff = json.loads(await asyncio.to_thread(sys.stdin.readline))
    event = open_event(handoff["event"])
    say(complete_at_start=event.query())
    ok = await asyncio.to_thread(event.wait, 60.0)
    block_bytes = handoff["block_bytes"]
    good = all(
        bool(torch.all(reg.block(off, block_bytes) == pattern(i)))
        for i, off in enumerate(handoff["offsets"])
    )
    freed = await client.free_blocks(handoff["offsets"])
    say(waited=ok, data_ok=good, freed=freed.num_freed)
    await client.close()


async def holder(client: CacheClient, model: str) -> None:
    await client.register()
    alloc = await client.alloc_blocks(SHAPE, NUM_BLOCKS)
    await client.load_model(model)
    say(held=alloc.offsets)
    await asyncio.sleep(3600)


async def run(role: str, address: str, worker_id: str, arg: str | None) -> None:
    client = CacheClient(address, worker_id)
    roles = {
        "producer": lambda: producer(client, str(arg)),
        "consumer": lambda: consumer(client),
        "holder": lambda: holder(client, str(arg)),
    }
    await roles[role]()


def main() -> None:
    role, address, worker_id, *rest = sys.argv[1:]
    asyncio.run(run(role, address, worker_id, rest[0] if rest else None))


if __name__ == "__main__":
    main()
