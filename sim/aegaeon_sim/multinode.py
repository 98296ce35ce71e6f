"""The paper's cluster and 10x it, as the replicated proxy layer dispatches to it.

``python -m aegaeon_sim.multinode [--redis URL] [--json]``

1. **Attainment**: the simulator (the same policy objects as the live proxy)
   on the paper's 2 x 8 GPUs (6 prefill + 10 decode instances, Fig. 11a's
   market at 0.1 RPS per model) and on 10x that (20 nodes: 60 + 100
   instances, 10x the models at the same per-model rate).
2. **Dispatch cost**: one arrival's decision as a replica makes it
   (``aegaeon_sched.shared.dispatch_prefill`` over every node's prefill queue,
   msgpack in and out, then the placement within one node), at 2, 20
   and 100 nodes, with queues as full as the simulated cluster's; and, with
   ``--redis``, whole store transactions from 1, 2 and 4 replicas at once
   against a real Redis: decisions per second and the share that conflicted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import msgspec
from aegaeon_sched import PrefillQueue, Request
from aegaeon_sched.shared import dispatch_prefill, place_decode, prefill_queue_of, work_list_of

from aegaeon_sim.hardware import H800, latency_model, market
from aegaeon_sim.runner import Scenario, run_scenario

PREFILL_PER_NODE = 3  # the paper's 6 prefill + 10 decode over 2 nodes
DECODE_PER_NODE = 5


def attainment(scale: int, duration_s: float) -> dict[str, Any]:
    models = 40 * scale
    sc = Scenario("aegaeon", models, 0.1, duration_s=duration_s, num_prefill=6 * scale,
                  num_decode=10 * scale)  # fmt: skip
    started = time.perf_counter()
    result = run_scenario(sc)
    wall_s = time.perf_counter() - started
    return {"nodes": 2 * scale, "gpus": 16 * scale, "models": models,
            "attainment": result.report.attainment, "wall_s": wall_s}  # fmt: skip


def _states(nodes: int, models: list[str], depth: int, rng: random.Random
            ) -> dict[str, PrefillQueue]:  # fmt: skip
    """Every node's prefill queues, ``depth`` groups each of random models."""
    out: dict[str, PrefillQueue] = {}
    for n in range(nodes):
        for p in range(PREFILL_PER_NODE):
            queue = PrefillQueue(loaded_model=rng.choice(models))
            for g in range(depth):
                model = rng.choice(models)
                for k in range(rng.randint(1, 4)):
                    req = Request(f"r{n}-{p}-{g}-{k}", model, 0.0, rng.randint(100, 2000), 300)
                    queue.add(req, n * 10_000 + p * 100 + g)
            out[f"node-{n}/prefill-{p}"] = queue
    return out


def dispatch_cost(nodes: int, samples: int = 200) -> dict[str, Any]:
    rng = random.Random(nodes)
    archs = market(40)
    lat = latency_model(archs, H800)
    names = list(archs)
    raw = {k: msgspec.msgpack.encode(v) for k, v in _states(nodes, names, 3, rng).items()}
    decode = [f"node-0/decode-{d}" for d in range(DECODE_PER_NODE)]  # empty work lists
    caps = {k: dict.fromkeys(names, 200_000) for k in decode}
    started = time.perf_counter()
    for i in range(samples):
        req = Request(f"x{i}", rng.choice(names), 0.0, 600, 300)
        queues = {k: prefill_queue_of(v) for k, v in raw.items()}
        _, _, queue = dispatch_prefill(queues, req, lat, 0.0, new_group_id=10**9 + i)
        msgspec.msgpack.encode(queue)
        dstates = {k: work_list_of(None) for k in decode}
        _, _, dstate = place_decode(dstates, req, new_batch_id=10**9 + i, capacity_tokens=caps,
                                    latency=lat, tbt_s=0.1)  # fmt: skip
        msgspec.msgpack.encode(dstate)
    per_s = (time.perf_counter() - started) / samples
    return {"nodes": nodes, "prefill_instances": nodes * PREFILL_PER_NODE,
            "decision_ms": per_s * 1e3, "decisions_per_s_one_core": 1 / per_s}  # fmt: skip


async def _replicas(url: str, nodes: int, replicas: int, seconds: float) -> dict[str, Any]:
    from aegaeon_common.store_redis import RedisStore

    archs = market(40)
    lat = latency_model(archs, H800)
    names = list(archs)
    namespace = f"simbench{nodes}x{replicas}"
    seed = RedisStore(url, namespace)
    states = _states(nodes, names, 3, random.Random(1))
    for key, state in states.items():
        await seed.put(f"pq:{key}", msgspec.msgpack.encode(state))
    keys = [f"pq:{k}" for k in states]
    stores = [RedisStore(url, namespace) for _ in range(replicas)]
    counts = [0] * replicas

    async def replica(i: int) -> None:
        rng = random.Random(100 + i)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            req = Request(f"q{i}-{counts[i]}", rng.choice(names), 0.0, 600, 300)

            def decide(
                values: list[bytes | None], req: Request = req
            ) -> tuple[dict[str, bytes | None], None]:
                cur = {k[3:]: prefill_queue_of(v) for k, v in zip(keys, values, strict=True)}
                gid = rng.getrandbits(40)
                inst, _, queue = dispatch_prefill(cur, req, lat, 0.0, new_group_id=gid)
                # keep queues at a steady depth: the oldest group leaves as the new one joins
                queue = PrefillQueue(loaded_model=queue.loaded_model, groups=queue.groups[-4:])
                return {f"pq:{inst}": msgspec.msgpack.encode(queue)}, None

            await stores[i].transact(keys, decide, retries=1000)
            counts[i] += 1

    await asyncio.gather(*(replica(i) for i in range(replicas)))
    commits = sum(s.num_commits for s in stores)
    conflicts = sum(s.num_conflicts for s in stores)
    await seed.delete(*keys)
    for s in (seed, *stores):
        await s.close()
    return {"nodes": nodes, "replicas": replicas, "decisions_per_s": commits / seconds,
            "conflict_share": conflicts / max(1, commits + conflicts)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="a Redis URL: measure store transactions too")
    parser.add_argument("--duration", type=float, default=300.0, help="simulated arrivals (s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: dict[str, Any] = {
        "attainment": [attainment(s, args.duration) for s in (1, 10)],
        "dispatch": [dispatch_cost(n) for n in (2, 20, 100)],
    }
    if args.redis:
        out["store"] = [asyncio.run(_replicas(args.redis, n, r, 5.0))
                        for n in (2, 20) for r in (1, 2, 4)]  # fmt: skip
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
