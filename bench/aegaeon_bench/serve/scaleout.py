"""Scale-out and faults of the multi-node shape on this machine (docs/results.md).

``python -m aegaeon_bench.serve.scaleout --market DIR --out FILE.json [--nodes 1,2,3]``

(a) For each node count: ``aegaeon serve --nodes N --proxies 2`` (one Redis,
    every node its own process group on loopback tcp), then ``aegaeon bench
    serve`` against both replicas at once (each replica half of every model's
    rate) for growing model counts; attainment and tokens/s per point.
(b) kill -9 one proxy replica under load; (c) kill -9 every process of one
    node under load; (d) start one more node under load. For each: how every
    request ended (completed, clean error, cut with its replica, hung) and
    when the system noticed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from aegaeon_bench.node.client import served_models, status_error
from aegaeon_bench.node.http_client import fetch_sync, sse_events
from aegaeon_bench.node.launch import aegaeon_argv, bench_serve_argv, interrupt, start_node


class Cluster:
    def __init__(self, market: Path, nodes: int, root: Path) -> None:
        self.nodes = nodes
        started = time.monotonic()
        here = Path(tempfile.mkdtemp(prefix=f"n{nodes}-", dir=root))  # a cluster's own
        self.node = start_node(market, "aegaeon", here, None, ports=2,
                               extra_args=("--nodes", str(nodes), "--proxies", "2"))
        self.ready_s = time.monotonic() - started
        assert self.node.run_dir is not None
        self.run_dir = self.node.run_dir
        port = int(self.node.url.rpartition(":")[2])
        self.urls = [self.node.url, f"http://127.0.0.1:{port + 1}"]
        config = yaml.safe_load((self.run_dir / "node-0" / "config.yaml").read_text())
        self.store_url = config["store"]["url"]

    def stats(self, replica: int = 0) -> dict[str, Any]:
        reply = fetch_sync("GET", f"{self.urls[replica]}/v1/aegaeon/stats?light=1", timeout_s=10)
        if reply.status != 200:
            raise status_error("GET /v1/aegaeon/stats", reply.status)
        data: dict[str, Any] = reply.json()
        return data

    def node_pids(self, node: str) -> list[int]:
        return sorted({int(p.read_text()) for p in (self.run_dir / node).glob("*.ready")})

    def stop(self) -> None:
        self.node.stop(120.0)


def _bench(url: str, models: int, rps: float, duration: float, out: Path) -> dict[str, Any]:
    argv = bench_serve_argv(url, models=models, rps=rps, duration=duration, input_scale=0.25,
                            output_scale=0.25, ttft=2.5, tbt=0.1)
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
    out.write_text(done.stdout + done.stderr)
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), "{}")
    result: dict[str, Any] = json.loads(line)
    return result


def scale_point(cluster: Cluster, models: int, rps: float, duration: float,
                root: Path) -> dict[str, Any]:  # fmt: skip
    """Both replicas at once, each half of every model's rate."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(
            lambda i: _bench(cluster.urls[i], models, rps / 2, duration,
                             root / f"bench-n{cluster.nodes}-m{models}-r{i}.txt"),
            range(2)))  # fmt: skip
    sums = [r.get("summary", r) for r in runs]
    expected = sum(int(r.get("tokens_expected") or 0) for r in sums)
    met = sum(int(r.get("tokens_met") or 0) for r in sums)
    received = sum(int(r.get("tokens_received") or 0) for r in sums)
    return {"nodes": cluster.nodes, "models": models, "rps_per_model": rps,
            "attainment": met / expected if expected else 0.0,
            "tokens_per_s": received / duration, "failed": sum(r.get("failed") or 0 for r in sums),
            "requests": sum(r.get("requests") or 0 for r in sums), "runs": runs}  # fmt: skip


async def _stream(session: aiohttp.ClientSession, url: str, model: str, n: int,
                  out: list[dict[str, Any]], hang_s: float) -> None:  # fmt: skip
    body = {"model": model, "prompt": "x " * 40, "max_tokens": n, "stream": True,
            "ignore_eos": True}  # fmt: skip
    rec: dict[str, Any] = {"url": url, "outcome": "hung", "t0": time.monotonic()}
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=hang_s)) as resp:
            if resp.status != 200:
                rec["outcome"] = f"http_{resp.status}"
            else:
                async for _, event in sse_events(resp):
                    if event is None:
                        break
                    if "error" in event:
                        rec["outcome"] = f"error:{event['error'].get('code')}"
                    elif any(c.get("finish_reason") for c in event.get("choices", ())):
                        rec["outcome"] = "completed"
    except TimeoutError:
        rec["outcome"] = "hung"
    except aiohttp.ClientError:
        rec["outcome"] = "cut"
    rec["t1"] = time.monotonic()
    out.append(rec)


async def _load(urls: list[str], models: list[str], seconds: float, gap_s: float,
                out: list[dict[str, Any]]) -> None:  # fmt: skip
    async with aiohttp.ClientSession() as session:
        tasks = []
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            model = models[i % len(models)]
            tasks.append(asyncio.ensure_future(_stream(session, urls[i % 2], model, 64, out, 90.0)))
            i += 1
            await asyncio.sleep(gap_s)
        await asyncio.gather(*tasks)


def faults(market: Path, root: Path) -> dict[str, Any]:
    import threading

    cluster = Cluster(market, 2, root)
    out: dict[str, Any] = {"ready_s": cluster.ready_s}
    models = served_models(cluster.urls[0])[:4]
    try:
        # (b) one replica killed under load
        recs: list[dict[str, Any]] = []
        victim = int((cluster.run_dir / "proxy-1" / "proxy.ready").read_text())
        timer = threading.Timer(4.0, os.kill, (victim, signal.SIGKILL))
        timer.start()
        asyncio.run(_load(cluster.urls, models, 10.0, 0.25, recs))
        survivors = Counter(r["outcome"] for r in recs if r["url"] == cluster.urls[0])
        outcomes = Counter(r["outcome"] for r in recs)
        out["proxy_kill"] = {"sent": len(recs), "outcomes": dict(outcomes),
                             "survivor_outcomes": dict(survivors)}  # fmt: skip
        time.sleep(8)  # the replica restarts (supervisor)
        # (c) one node killed under load
        recs = []
        seen: dict[str, float] = {}

        def kill_node() -> None:
            pids = cluster.node_pids("node-1")
            seen["killed"] = time.monotonic()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            while time.monotonic() - seen["killed"] < 15:
                if "node-1" not in cluster.stats(0)["nodes"]:
                    seen["removed"] = time.monotonic()
                    return
                time.sleep(0.1)

        timer = threading.Timer(4.0, kill_node)
        timer.start()
        asyncio.run(_load(cluster.urls, models, 10.0, 0.25, recs))
        timer.join()
        out["node_kill"] = {
            "sent": len(recs), "outcomes": dict(Counter(r["outcome"] for r in recs)),
            "removed_after_s": seen.get("removed", float("nan")) - seen["killed"],
        }  # fmt: skip
        time.sleep(15)  # node-1 restarts
        # (d) a third node started under load
        recs = []
        node_cfg = yaml.safe_load((cluster.run_dir / "node-1" / "config.yaml").read_text())
        node_cfg["node"] = {**node_cfg["node"], "name": "node-2",
                            "base_port": int(node_cfg["node"]["base_port"]) + 100}
        node_cfg["run_dir"] = str(cluster.run_dir / "node-2")
        (cluster.run_dir / "node-2").mkdir(mode=0o700, exist_ok=True)
        path = cluster.run_dir / "node-2" / "config.yaml"
        path.write_text(yaml.safe_dump(node_cfg))
        joined: dict[str, float] = {}

        def add_node() -> None:
            joined["started"] = time.monotonic()
            joined["proc"] = subprocess.Popen(  # type: ignore[assignment]
                aegaeon_argv("node", "--config", str(path)),
                stdout=(root / "node-2.log").open("wb"), stderr=subprocess.STDOUT)
            while time.monotonic() - joined["started"] < 120:
                if "node-2" in cluster.stats(0)["nodes"]:
                    joined["joined"] = time.monotonic()
                    return
                time.sleep(0.2)

        adder = threading.Thread(target=add_node)
        adder.start()
        asyncio.run(_load(cluster.urls, models, 40.0, 0.25, recs))
        adder.join()
        import redis

        client = redis.Redis.from_url(cluster.store_url)
        took = sorted(k.decode() for k in client.scan_iter("aegaeon:pq:node-2/*"))
        client.close()
        out["node_add"] = {
            "sent": len(recs), "outcomes": dict(Counter(r["outcome"] for r in recs)),
            "joined_after_s": joined.get("joined", float("nan")) - joined["started"],
            "new_node_prefill_queues": took,
        }  # fmt: skip
        proc = joined.get("proc")
        if isinstance(proc, subprocess.Popen):
            interrupt(proc, 60.0, signal.SIGTERM)
    finally:
        cluster.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--market", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--models", default="2,4,6")
    parser.add_argument("--rps", type=float, default=0.2)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--skip-faults", action="store_true")
    args = parser.parse_args()
    root = args.out.parent / (args.out.stem + "-runs")
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"cpu": os.cpu_count(), "scale": [], "args": vars(args) | {
        "market": str(args.market), "out": str(args.out)}}
    for n in (int(x) for x in args.nodes.split(",")):
        cluster = Cluster(args.market, n, root)
        try:
            for m in (int(x) for x in args.models.split(",")):
                point = scale_point(cluster, m, args.rps, args.duration, root)
                point["ready_s"] = cluster.ready_s
                result["scale"].append(point)
                print(json.dumps({k: v for k, v in point.items() if k != "runs"}), flush=True)
                args.out.write_text(json.dumps(result, indent=1))
        finally:
            cluster.stop()
    if not args.skip_faults:
        result["faults"] = faults(args.market, root)
        print(json.dumps(result["faults"]), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
