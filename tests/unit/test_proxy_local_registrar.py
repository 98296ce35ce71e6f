"""One node's instances in the store (``cluster.local_registrar``): the proxy writes the
records their hellos and heartbeats give, answers a first hello with ``ProxyStarted`` and
a drain with ``AckDrain``, and a stalled or ended instance's record goes at once; the
backend over the memory store dispatches from those records, holds a decode placement
no decode instance takes yet, and learns from measured prefills."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio
from aegaeon_common.config import Config, config_from_dict
from aegaeon_common.messages.decode import DECODE_CHANNEL, EnqueueDecode
from aegaeon_common.messages.prefill import (
    PREFILL_CHANNEL,
    AckDrain,
    EnqueuePrefill,
    ProxyStarted,
)
from aegaeon_common.messages.report import (
    InstanceDraining,
    InstanceHello,
    InstanceStalled,
    InstanceStats,
    PrefillDone,
)
from aegaeon_common.messages.structs import (
    Holdings,
    KVHandoff,
    KVShapeSpec,
    RequestTimings,
    SamplingParams,
)
from aegaeon_common.registry import InstanceRecord, decode_instance, instance_key
from aegaeon_common.transport import Puller
from aegaeon_common.wire import Message
from aegaeon_proxy.backend import BackendError, GenerationRequest
from aegaeon_proxy.cluster import backend as cluster_backend
from aegaeon_proxy.cluster.backend import ClusterBackend
from aegaeon_proxy.cluster.local_registrar import LocalRegistrar
from fake_worker import latency_profile


def _config(tmp_path: Path, **extra: object) -> Config:
    return config_from_dict({"models": [{"name": "m", "path": "x"}], "run_dir": str(tmp_path),
                             **extra})  # fmt: skip


def _hello(kind: str = "prefill", pid: int = 10, incarnation: int = 1) -> InstanceHello:
    return InstanceHello(kind, 0, pid, 1 << 20, 1 << 20, 8, {"m": 4096},
                         incarnation=incarnation)  # fmt: skip


def _stats(kind: str = "prefill", open_sequences: int = 2, version: int = 1) -> InstanceStats:
    return InstanceStats(kind, 0, "m", 1, 1, {"open_sequences": float(open_sequences)},
                         holdings=Holdings(version, 3, open_sequences, 1))  # fmt: skip


class _Sink:
    """What the registrar writes and sends, in order."""

    def __init__(self) -> None:
        self.records: dict[str, InstanceRecord | None] = {}
        self.sent: list[tuple[str, Message]] = []

    def put(self, record: InstanceRecord, live: bool) -> None:
        self.records[record.instance_id] = record if live else None

    def send(self, record: InstanceRecord, msg: Message) -> None:
        self.sent.append((record.instance_id, msg))


def test_one_node_names_its_instances_and_many_nodes_none(tmp_path: Path) -> None:
    sink = _Sink()
    assert LocalRegistrar(_config(tmp_path), sink.put, sink.send).expected == \
        ("prefill-0", "decode-0")  # fmt: skip
    redis = _config(tmp_path, store={"kind": "redis"}, node={"advertise_address": "127.0.0.1"})
    assert LocalRegistrar(redis, sink.put, sink.send).expected == ()


def test_hellos_and_heartbeats_become_records_and_a_first_hello_is_answered(
    tmp_path: Path,
) -> None:
    sink = _Sink()
    local = LocalRegistrar(_config(tmp_path), sink.put, sink.send)
    local.on_hello(InstanceHello("prefill", 7, 1, 1, 1, 1))  # not this node's: ignored
    assert sink.records == {}
    local.on_hello(_hello())
    local.on_hello(_hello())  # every beat repeats it: one ProxyStarted per instance
    record = sink.records["prefill-0"]
    assert record is not None and record.incarnation == 1 and record.capacity_tokens == {"m": 4096}
    assert record.node == "local" and record.address.endswith("prefill-0.sock")
    assert [(n, type(m)) for n, m in sink.sent] == [("prefill-0", ProxyStarted)]
    local.on_stats(_stats())
    record = sink.records["prefill-0"]
    assert record is not None and record.load.open_sequences == 2
    assert record.load.active_model == "m"
    # a message about a request holds a newer reading than the heartbeat; an older one
    # (a lower version of the same process) never replaces it
    local.note_holdings("prefill", 0, Holdings(5, 0, 0, 1))
    local.note_holdings("prefill", 0, Holdings(4, 9, 9, 1))
    local.note_holdings("prefill", 0, Holdings(9, 9, 9, 2))  # another process's
    assert local.instances["prefill-0"].holdings == Holdings(5, 0, 0, 1)
    # a restarted process: a new record (the replicas' refresh sees the old one leave)
    local.on_hello(_hello(pid=11, incarnation=2))
    record = sink.records["prefill-0"]
    assert record is not None and (record.pid, record.incarnation) == (11, 2)
    assert record.load.open_sequences == 0 and local.instances["prefill-0"].holdings is None


def test_a_drain_is_acknowledged_and_counts_as_restarting(tmp_path: Path) -> None:
    sink = _Sink()
    local = LocalRegistrar(_config(tmp_path), sink.put, sink.send)
    local.on_hello(_hello())
    assert local.on_draining(InstanceDraining("prefill", 0, 99, 5.0)) is None  # not its pid
    drained = local.on_draining(InstanceDraining("prefill", 0, 10, 5.0))
    assert drained is not None and drained.draining
    record = sink.records["prefill-0"]
    assert record is not None and record.draining
    assert isinstance(sink.sent[-1][1], AckDrain) and sink.sent[-1][1].pid == 10
    assert local.restarting("prefill-0", 0.0) and not local.restarting("decode-0", 0.0)
    local.on_stats(_stats())  # its beats while it drains keep the record draining
    record = sink.records["prefill-0"]
    assert record is not None and record.draining
    assert not local.ended("prefill-0")  # a drained process exits on purpose
    local.on_hello(_hello(pid=12, incarnation=3))  # its successor
    record = sink.records["prefill-0"]
    assert record is not None and not record.draining and not local.restarting("prefill-0", 0.0)


def test_a_stalled_or_ended_instance_leaves_at_once(tmp_path: Path) -> None:
    sink = _Sink()
    local = LocalRegistrar(_config(tmp_path), sink.put, sink.send)
    local.on_hello(_hello())
    local.on_hello(_hello("decode"))
    assert not local.on_stalled(InstanceStalled("prefill", 0, 99, 40.0))  # not its pid
    assert local.on_stalled(InstanceStalled("prefill", 0, 10, 40.0, "a step"))
    assert sink.records["prefill-0"] is None
    local.on_stats(_stats())  # a late heartbeat does not bring it back
    local.on_hello(_hello())  # nor a hello of the stalled process
    assert sink.records["prefill-0"] is None and not local.up("prefill-0", 1e12)
    local.on_hello(_hello(pid=13, incarnation=4))  # its successor does
    assert sink.records["prefill-0"] is not None
    # the decode instance's process ended (its socket disconnected)
    assert local.ended("decode-0") and sink.records["decode-0"] is None
    local.on_stats(_stats("decode"))
    assert sink.records["decode-0"] is None and not local.ended("decode-0")
    local.leave()  # this proxy stops: each instance up hears it
    assert [n for n, m in sink.sent if isinstance(m, AckDrain)] == ["prefill-0"]


async def test_the_backend_over_the_memory_store_dispatches_from_those_records(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path)
    ctx = zmq.asyncio.Context()
    instance = Puller(ctx, config.prefill_address(0), PREFILL_CHANNEL)
    backend = ClusterBackend(config)
    try:
        assert backend.report_address == config.proxy_address
        assert not backend.ready()
        backend.local.on_hello(_hello())
        msg = await asyncio.wait_for(instance.recv(), 5.0)
        assert isinstance(msg, ProxyStarted)
        raw = await backend.store.get(instance_key("prefill-0"))
        assert raw is not None and decode_instance(raw).pid == 10
        joined, _ = await backend.view.refresh()
        assert [r.instance_id for r in joined] == ["prefill-0"]
        assert backend.down() == ["decode-0"]
        assert backend.health()["instances"]["decode-0"] == {  # type: ignore[index]
            "alive": False, "pid": None, "active_model": None}  # fmt: skip
        backend._on_draining(InstanceDraining("prefill", 0, 10, 5.0))
        assert backend.view.live["prefill-0"].draining  # no new work at once
        assert not backend.view.prefill_candidates()
        msg = await asyncio.wait_for(instance.recv(), 5.0)
        assert isinstance(msg, AckDrain)
        rows = backend._instances({})  # (no cachemgr answered)
        assert [(r["name"], r["draining"], r["leases"]) for r in rows] == [("prefill-0", True, -1)]
    finally:
        await backend.stop()
        instance.close()
        ctx.destroy(linger=0)


async def test_a_new_instance_joins_the_view_at_once_not_a_refresh_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's start waits on its instances joining the proxy's view: a new record wakes
    the registry's refresh (here a refresh an hour apart: only the wake can do it)."""
    monkeypatch.setattr(cluster_backend, "REFRESH_S", 3600.0)
    backend = ClusterBackend(_config(tmp_path))
    await backend.start()
    try:
        for _ in range(500):  # the first refresh (the store answered), before any hello
            if backend._store_ok:
                break
            await asyncio.sleep(0.01)
        assert backend._store_ok and not backend.view.live
        for kind in ("prefill", "decode"):
            backend.local.on_hello(_hello(kind))
        for _ in range(500):
            if set(backend.view.live) == {"prefill-0", "decode-0"}:
                break
            await asyncio.sleep(0.01)
        assert set(backend.view.live) == {"prefill-0", "decode-0"}
        assert backend.down() == []
    finally:
        await backend.stop()


async def _recv(pull: Puller, tag: type[Message]) -> Message:
    """The next message of type ``tag`` (the ProxyStarted before it skipped)."""
    while True:
        msg = await asyncio.wait_for(pull.recv(), 5.0)
        if isinstance(msg, tag):
            return msg


async def test_a_decode_placement_waits_for_a_decode_instance_and_prefills_teach_latency(
    tmp_path: Path,
) -> None:
    """One node, its decode instance draining (no prefill instance decodes): a prefilled
    request is held (``held_requests``) with its handoff at the prefill instance, and
    placed once the decode instance's successor says hello; the measured prefill time
    is what the latency model learns from."""
    config = _config(tmp_path, scheduler={"prefill_decodes_when_idle": False})
    ctx = zmq.asyncio.Context()
    prefill = Puller(ctx, config.prefill_address(0), PREFILL_CHANNEL)
    decode = Puller(ctx, config.decode_address(0), DECODE_CHANNEL)
    backend = ClusterBackend(config)
    profile = latency_profile(["m"])
    try:
        for kind in ("prefill", "decode"):
            backend.local.on_hello(msgspec.structs.replace(_hello(kind), latency=profile))
        backend._on_draining(InstanceDraining("decode", 0, 10, 5.0))
        await asyncio.sleep(0.05)  # (the records written)
        await backend.view.refresh()
        backend._store_ok = backend._checked = True
        assert backend.ready()  # (the draining instance restarts: its work waits here)
        gen = GenerationRequest("r", "m", tuple(range(8)), SamplingParams(max_tokens=4), 0.0)
        backend.submit(gen)
        work = await _recv(prefill, EnqueuePrefill)
        assert isinstance(work, EnqueuePrefill) and work.request_id == "r"
        latency = backend.view.latency()
        assert latency is not None
        taught: list[tuple[str, list[int], float]] = []
        observe = latency.observe_prefill

        def spy(model: str, prompt_lens: list[int], seconds: float) -> None:
            taught.append((model, list(prompt_lens), seconds))
            observe(model, prompt_lens, seconds)

        latency.observe_prefill = spy  # type: ignore[method-assign,assignment]
        handoff = KVHandoff(KVShapeSpec(2, 2, 16, 16, "bfloat16"), [0], 8)
        timings = RequestTimings(prefill_s=0.25)
        backend._on_prefill_done(PrefillDone("r", 0, 7, None, handoff, timings, 0.0))
        for _ in range(100):
            if (len(backend.held), len(backend.held_decode)) == (0, 1):
                break
            await asyncio.sleep(0.01)
        assert (len(backend.held), len(backend.held_decode)) == (0, 1)
        assert backend.view.latency() is latency and taught == [("m", [8], 0.25)]
        backend.local.on_hello(_hello("decode", pid=11, incarnation=2))  # its successor
        await asyncio.sleep(0.05)  # (the record written)
        await backend.view.refresh()
        backend.placement.refresh(0.0)
        placed = await _recv(decode, EnqueueDecode)
        assert isinstance(placed, EnqueueDecode) and placed.request_id == "r"
        assert placed.handoff == handoff and placed.incarnation == 2
        assert (len(backend.held), len(backend.held_decode)) == (0, 0)
    finally:
        await backend.stop()
        prefill.close()
        decode.close()
        ctx.destroy(linger=0)


async def test_an_instance_joining_has_its_cachemgr_asked_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy is ready once a cachemgr said which models it cannot read, asked through
    the live records: a start's first poll finds none, and the next one comes when an
    instance joins, not a poll period later (here: never by the clock)."""
    monkeypatch.setattr(cluster_backend, "WATCH_S", 3600.0)
    config = _config(tmp_path)
    ctx = zmq.asyncio.Context()
    instance = Puller(ctx, config.prefill_address(0), PREFILL_CHANNEL)
    backend = ClusterBackend(config)
    asked: list[list[str]] = []

    async def check_unavailable(asked_at: float) -> None:
        asked.append(sorted(backend.view.live))
        if not backend.view.live:  # no record: no cachemgr to ask
            raise BackendError.unavailable("no node's cachemgr answered")

    backend.models.check_unavailable = check_unavailable  # type: ignore[method-assign]
    loops = [asyncio.create_task(backend._refresh_loop()),
             asyncio.create_task(backend._unavailable_loop())]  # fmt: skip
    try:
        while not asked:
            await asyncio.sleep(0.01)
        assert asked == [[]] and not backend._checked
        backend.local.on_hello(_hello())
        async with asyncio.timeout(10.0):
            while not backend._checked:
                await asyncio.sleep(0.01)
        assert asked == [[], ["prefill-0"]]
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await backend.stop()
        instance.close()
        ctx.destroy(linger=0)
