"""`aegaeon bench chaos`, short and deterministic: every fault under a small steady load
through `aegaeon serve`. Outcomes, not speed: no request hangs, the node serves again,
only what the fault kills restarts, and nothing leaks (KV blocks, leases, sequences,
open requests, shared memory, processes). The timed figures are in docs/reliability.md."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from aegaeon_bench.reliability.chaos_run import ChaosNode, ChaosOptions, run_chaos
from aegaeon_bench.reliability.faults import FAULTS
from serve_harness import Served

# short holds: the stop still outlasts the proxy's heartbeat timeout (5 s)
CI_FAULTS = [
    FAULTS["kill_decode"],
    FAULTS["kill_prefill"],
    dataclasses.replace(FAULTS["stop_decode"], hold_s=6.0),
    dataclasses.replace(FAULTS["fill_shm"], hold_s=2.0),
    FAULTS["kill_cachemgr"],
    FAULTS["kill_proxy"],
]


def _greedy(served: Served, model: str) -> str:
    client = served.client(60)
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    return reply.choices[0].text


def _warnings(served: Served, most: int = 60) -> list[str]:
    """The node's last warnings and errors (what a leak's report is read beside)."""
    lines = served.log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if "warn" in line.lower() or "error" in line.lower()][-most:]


def test_every_fault_ends_cleanly_recovers_and_leaks_nothing(served: Served) -> None:
    model = served.get_json("/v1/models")["data"][0]["id"]  # type: ignore[index]
    before = _greedy(served, model)
    node = ChaosNode(served.url, served.run_dir, served.proc.pid)
    # /dev/shm here is the machine's: the fill is bounded (the benchmark fills a
    # private one near full)
    opts = ChaosOptions(faults=CI_FAULTS, slot_s=6.0, seed=0, concurrency=2,
                        request_timeout_s=20.0, shm_max_fill_bytes=64 << 20)  # fmt: skip
    report = asyncio.run(run_chaos(node, opts))
    print(json.dumps(report["faults"], indent=1, default=str))  # whole rows, when one fails
    for row in report["faults"]:
        assert row["hung"] == 0, row
        assert row["recovery_s"] is not None, row
        assert not row["leaks"], ({k: row[k] for k in (
            "fault", "holdings", "stale_shm_segments", "stray_processes", "missing_services")},
            _warnings(served))  # fmt: skip
        assert not row["unexpected_restarts"], row
        assert set(row["restarted"]) == set(
            next(f for f in CI_FAULTS if f.name == row["fault"]).restarts
        ), row
    assert report["requests"]["hung"] == 0 and report["ok"], report
    kinds = {row["fault"]: row for row in report["faults"]}
    # a dead proxy drops its connections; every other fault ends requests in a typed way
    for name, row in kinds.items():
        if name != "kill_proxy":
            assert row["in_flight_outcomes"]["connection"] == 0, row
    assert _greedy(served, model) == before  # the restarted services answer the same
    assert "child died" in served.log_path.read_text()
    assert served.proc.poll() is None  # `aegaeon serve` itself rode every fault out
