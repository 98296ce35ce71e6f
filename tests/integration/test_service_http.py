"""The side HTTP servers of the cachemgr and of a worker instance, as real processes.

A worker is unready (503) before it has a cachemgr and warmed up, ready once
it has, unready again while it drains after SIGTERM, and gone (its address
file removed) after a clean exit; the cachemgr counts every request it answers.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from aegaeon_common.http_side import read_http_address
from aegaeon_runtime.cacheclient.client import CacheClient
from cachemgr_harness import CacheMgrProcess, checkpoint, write_config
from http_support import get_text, metric_samples


def _wait_for(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_cachemgr_counts_the_requests_it_answers(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, {"m": checkpoint()})
    with CacheMgrProcess(config_path) as mgr:
        run_dir = mgr.config.run_dir
        address = read_http_address(run_dir, "cachemgr")
        assert address is not None and address.role == "cachemgr"
        assert get_text(f"{address.url}/health")[0] == 200
        assert get_text(f"{address.url}/ready")[0] == 200

        async def talk() -> None:
            client = CacheClient(mgr.config.cachemgr_address, "probe")
            try:
                for _ in range(5):
                    await client.stats()
            finally:
                await client.close(unregister=False)

        asyncio.run(talk())
        got = metric_samples(f"{address.url}/metrics")
        ok = ("outcome", "ok"), ("type", "cache.get_stats")
        assert got[("aegaeon_cachemgr_requests_total", ok)] == 5
        assert got[("aegaeon_model_cache_capacity_bytes", ())] == 64 << 20
        assert ("aegaeon_model_cache_misses_total", ()) in got
        assert ("process_open_fds", ()) in got
        assert mgr.stop() == 0
        assert read_http_address(run_dir, "cachemgr") is None


def test_a_worker_is_unready_until_warm_and_while_draining(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, {"m": checkpoint()})
    raw = yaml.safe_load(config_path.read_text())
    raw["decode"] = {"instances": 1, "device_memory": "48MiB", "kv_memory": "16MiB"}
    raw["prefill"] = {"instances": 0}
    raw["drain_timeout"] = 30
    config_path.write_text(yaml.safe_dump(raw))
    run_dir = Path(raw["run_dir"])
    log_path = tmp_path / "decode-0.log"
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "aegaeon_cli.main", "decode", "--config", str(config_path),
             "--index", "0"], stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    mgr = CacheMgrProcess(config_path)
    try:
        address = _wait_for(lambda: read_http_address(run_dir, "decode-0"), 60, "decode-0.http")
        assert address.role == "decode"
        # no cachemgr yet: alive, not ready
        status, body = get_text(f"{address.url}/ready")
        assert status == 503 and json.loads(body)["reason"] != "ready"
        assert get_text(f"{address.url}/health")[0] == 200
        mgr.start()
        _wait_for(lambda: get_text(f"{address.url}/ready")[0] == 200, 180, "decode-0 ready")
        got = metric_samples(f"{address.url}/metrics")
        inst = (("instance", "decode-0"),)
        assert got[("aegaeon_decode_worklist_requests", inst)] == 0
        assert ("aegaeon_token_velocity_tokens_per_second", (*inst, ("stage", "decode"))) in got
        assert ("process_resident_memory_bytes", ()) in got

        worker.send_signal(signal.SIGTERM)
        # no proxy acknowledges the drain: the idle instance waits a moment for one
        def unready() -> tuple[int, str] | None:
            answer = get_text(f"{address.url}/ready")
            return answer if answer[0] != 200 else None

        seen = _wait_for(unready, 10, "/ready to turn 503 after SIGTERM")
        assert seen[0] == 503 and json.loads(seen[1])["reason"] == "draining"
        assert worker.wait(timeout=60) == 0, log_path.read_text(errors="replace")[-3000:]
        assert read_http_address(run_dir, "decode-0") is None
        assert '"drained"' in log_path.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if mgr.proc is not None:
            mgr.stop()


def test_a_draining_cachemgr_serves_its_workers_until_they_leave(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, {"m": checkpoint()})
    mgr = CacheMgrProcess(config_path).start()
    assert mgr.proc is not None
    address = read_http_address(mgr.config.run_dir, "cachemgr")
    assert address is not None

    async def scenario() -> None:
        client = CacheClient(mgr.config.cachemgr_address, "decode-0")
        await client.register(num_event_slots=1)
        try:
            assert mgr.proc is not None
            mgr.proc.send_signal(signal.SIGTERM)
            status, body = await asyncio.to_thread(_wait_for, lambda: (
                answer if (answer := get_text(f"{address.url}/ready"))[0] != 200 else None
            ), 10, "/ready to turn 503")  # fmt: skip
            assert status == 503 and json.loads(body)["reason"] == "draining"
            await client.stats()  # still answered while a worker holds a lease
            assert mgr.proc.poll() is None
        finally:
            await client.close()  # unregisters: the last lease ends

    try:
        asyncio.run(scenario())
        assert mgr.proc.wait(timeout=15) == 0
        assert '"draining"' in mgr.log()
    finally:
        if mgr.proc.poll() is None:
            mgr.stop(signal.SIGKILL)
