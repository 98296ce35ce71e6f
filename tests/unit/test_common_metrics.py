"""Metric helpers, the side HTTP server's pieces, and the worker's metric names and labels."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from aegaeon_common.http_side import (
    Readiness,
    ServiceAddress,
    SideServer,
    read_http_address,
    write_http_address,
)
from aegaeon_common.messages.report import SwitchRecord
from aegaeon_common.metrics import kv_block_counts, new_registry, shape_label
from aegaeon_runtime.metrics import InstanceCollector, InstanceLoad, WorkerMetrics
from aiohttp import ClientSession
from http_support import samples_of
from prometheus_client import generate_latest


def test_kv_block_counts_add_what_empty_slabs_hold() -> None:
    key = (2, 4, 64, 16, "bfloat16")
    shape = SimpleNamespace(block_bytes=1024, used_blocks=3, free_blocks=1)
    stats = SimpleNamespace(slab_bytes=4096, free_slabs=2, shapes={key: shape})
    assert shape_label(key) == "L2-H4-D64-B16-bfloat16"
    assert kv_block_counts(stats) == [("L2-H4-D64-B16-bfloat16", 3, 1 + 2 * 4)]


def test_registries_are_per_process_object_and_carry_process_metrics() -> None:
    a, b = new_registry(), new_registry()
    WorkerMetrics("decode-0", a).request_done("decode", "m", "length")
    WorkerMetrics("decode-0", b)  # same names in another registry: no clash
    names = {name for name, _ in samples_of(generate_latest(a).decode())}
    assert {"process_resident_memory_bytes", "process_open_fds"} <= names
    assert not any(name.endswith("_created") for name in names)


def test_worker_metric_names_and_labels() -> None:
    metrics = WorkerMetrics("prefill-0")
    metrics.request_done("prefill", "m1", "ok")
    metrics.request_done("prefill", "m1", "ok")
    metrics.tokens("arrival", "m1", 7)
    metrics.tokens("prefill", "m1", 7)
    metrics.switch(SwitchRecord(None, "m1", 0.02, 0.015, True, 0.0))
    load = InstanceLoad(prefill_requests=3, prefill_groups=2)
    metrics.registry.register(InstanceCollector(metrics, lambda: None, lambda: load))
    got = samples_of(generate_latest(metrics.registry).decode())
    inst = ("instance", "prefill-0")
    assert got[("aegaeon_instance_requests_total",
                (inst, ("model", "m1"), ("outcome", "ok"), ("stage", "prefill")))] == 2
    arrival = (inst, ("model", "m1"), ("stage", "arrival"))
    assert got[("aegaeon_instance_tokens_total", arrival)] == 7
    assert got[("aegaeon_model_switches_total", (inst, ("prefetched", "true")))] == 1
    assert got[("aegaeon_model_switch_duration_seconds_count", (inst, ("prefetched", "true")))] == 1
    assert got[("aegaeon_prefill_queue_requests", (inst,))] == 3
    assert got[("aegaeon_prefill_queue_groups", (inst,))] == 2
    assert got[("aegaeon_decode_worklist_requests", (inst,))] == 0
    velocity = got[("aegaeon_token_velocity_tokens_per_second", (inst, ("stage", "prefill")))]
    assert velocity == pytest.approx(0.7)  # 7 tokens over the 10 s window
    # a scrape reads only: a second one sees the same counters
    assert samples_of(generate_latest(metrics.registry).decode())[
        ("aegaeon_model_switches_total", (inst, ("prefetched", "true")))
    ] == 1  # fmt: skip


def test_http_address_files_round_trip(tmp_path: Path) -> None:
    address = ServiceAddress("decode-1", "decode", "http://127.0.0.1:9001")
    path = write_http_address(tmp_path, address)
    assert json.loads(path.read_text())["url"] == address.url
    assert read_http_address(tmp_path, "decode-1") == address
    assert read_http_address(tmp_path, "decode-2") is None
    assert address.to_dict() == {
        "name": "decode-1", "role": "decode", "health_url": "http://127.0.0.1:9001/health",
        "ready_url": "http://127.0.0.1:9001/ready", "metrics_url": "http://127.0.0.1:9001/metrics",
    }  # fmt: skip


async def test_side_server_ready_only_when_ready_and_not_draining(tmp_path: Path) -> None:
    readiness = Readiness()
    server = SideServer("cachemgr", "cachemgr", new_registry(), readiness,
                        host="127.0.0.1", port=0, run_dir=tmp_path)  # fmt: skip
    url = await server.start()
    assert read_http_address(tmp_path, "cachemgr") is not None
    try:
        async with ClientSession() as http:
            assert (await http.get(f"{url}/health")).status == 200
            assert (await http.get(f"{url}/ready")).status == 503
            readiness.set_ready()
            assert (await http.get(f"{url}/ready")).status == 200
            readiness.set_draining()
            resp = await http.get(f"{url}/ready")
            assert resp.status == 503
            assert (await resp.json())["reason"] == "draining"
            readiness.set_ready()  # a heartbeat after the drain began changes nothing
            assert (await http.get(f"{url}/ready")).status == 503
            text = await (await http.get(f"{url}/metrics")).text()
            assert "process_open_fds" in text
    finally:
        await server.stop()
    assert read_http_address(tmp_path, "cachemgr") is None

