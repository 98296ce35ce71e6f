"""A store restart does not take the nodes down: ``aegaeon serve --nodes 2 --proxies 2``
with its own redis-server, under a steady load through both replicas (every other
request streamed), the chaos bench's store faults in turn: ``store-kill`` (SIGKILL;
serve restarts it empty) and ``store-pause`` (SIGSTOP for twice the heartbeat TTL).

After each: every request sent from 10 s after the store is back succeeds; every
one before ends in a 200 or a 503 with Retry-After (a stream already answered: a
fault's error event), none a 500, none hung; every stream decoding at the fault
finishes; a model pinned, one with ``max_concurrency``, one added and one removed
before the faults keep their state on both replicas; both replicas list both nodes'
services again; nothing is left held. Outcomes only: the timings are in
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from aegaeon_bench.reliability.chaos_run import ChaosNode, ChaosOptions, run_chaos
from aegaeon_bench.reliability.faults import FAULTS
from serve_harness import Served, serve_config, serving


@pytest.fixture(scope="module")
def cluster(small_market: Path, market_names: list[str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # fmt: skip
    """Two nodes, two replicas, their private store; all the market but its last model
    (the run adds that one)."""
    models = [{"name": n, "path": str(small_market / n)} for n in market_names[:-1]]
    run_dir = tmp_path_factory.mktemp("multinode-store") / "run"
    with serving(small_market, run_dir, "--nodes", "2", "--proxies", "2",
                 config=serve_config(small_market, models=models)) as served:  # fmt: skip
        yield served


def test_the_store_killed_or_paused_loses_no_request_node_or_setting(
    cluster: Served, market_names: list[str]
) -> None:
    node = ChaosNode(cluster.url, cluster.run_dir, cluster.proc.pid, tuple(cluster.urls[1:]),
                     nodes=2)  # fmt: skip
    opts = ChaosOptions(faults=[FAULTS["store-kill"], FAULTS["store-pause"]], slot_s=6.0,
                        concurrency=3, request_timeout_s=30.0, offered_models=tuple(market_names),
                        stream=None, max_tokens=(32, 160),
                        after_answers=6)  # the "after" load: 2 answers per load slot # fmt: skip
    report = asyncio.run(run_chaos(node, opts))
    print(json.dumps(report, indent=1, default=str))  # the whole report, when one fails
    assert report["kept_state"]["added"] == market_names[-1]  # (a model the config lacks)
    for row in report["faults"]:
        answers = row["answers"]
        assert answers["after"]["sent"] > 0 and answers["after"]["num_other"] == 0, row
        assert answers["before"]["num_other"] == 0 and row["hung"] == 0, row
        assert answers["decoding_at_fault"]["completed"] == answers["decoding_at_fault"]["sent"]
        assert row["settings_kept"] == dict.fromkeys(
            ("pinned", "max_concurrency", "added", "removed"), True), row
        assert row["services_back_s"] is not None, row
        assert not row["leaks"] and row["restarted"] == list(
            next(f for f in opts.faults if f.name == row["fault"]).restarts), row
    assert report["ok"], report
    # a stream decoding at a fault finished: the load had some (over both faults)
    assert sum(r["answers"]["decoding_at_fault"]["sent"] for r in report["faults"]) > 0
