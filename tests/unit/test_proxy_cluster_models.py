"""The cluster backend's half of model lifecycle (``cluster.models.ClusterModels``), no
processes: what it tells the cachemgr and the instances, how an instance's answer
teaches the policy the new model, an instance that cannot read it, and a restarted
instance brought up to date."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.messages.cache import (
    ForgetModel,
    ModelForgotten,
    ModelRegistered,
    RegisterModel,
)
from aegaeon_common.messages.prefill import AddModel
from aegaeon_common.messages.report import InstanceHello, InstanceModels
from aegaeon_common.messages.structs import LatencyProfile
from aegaeon_common.wire import Message
from aegaeon_proxy.backend import BackendError
from aegaeon_proxy.cluster.instances import Instances, InstanceView
from aegaeon_proxy.cluster.models import ClusterModels
from aegaeon_sched import (
    SHARED,
    ClusterSpec,
    LatencyModel,
    ModelSpec,
    Policy,
    make_policy,
)

OLD, NEW = "old-model", "new-model"


def _latency(models: list[str]) -> LatencyModel:
    lat = LatencyModel([ModelSpec(m, 64, 128, 2, 1 << 20, 256) for m in models],
                       pcie_bytes_per_s=1e9)  # fmt: skip
    lat.set_prefill_coefficients(SHARED, (1e-9, 0.0, 0.0))
    lat.set_decode_coefficients(SHARED, (1e-9, 0.0))
    return lat


def _profile(models: list[str]) -> LatencyProfile:
    return msgspec.convert(_latency(models).to_dict(), LatencyProfile)


class Cache:
    """The cachemgr's answers (test double of the RPC client)."""

    def __init__(self) -> None:
        self.calls: list[Message] = []

    async def call(self, msg: Message, timeout_s: float = 30.0) -> Message:
        self.calls.append(msg)
        if isinstance(msg, RegisterModel):
            return ModelRegistered(msg.name)
        assert isinstance(msg, ForgetModel)
        return ModelForgotten(msg.name, True)


class Node:
    """Two instances said hello with ``OLD``; a real Aegaeon policy over them."""

    def __init__(self) -> None:
        views = {}
        for kind in ("prefill", "decode"):
            view = InstanceView(f"{kind}-0", kind, 0, pusher=None)  # type: ignore[arg-type]
            view.pid = 100
            view.hello = InstanceHello(kind, 0, 100, 1, 1, 8, {OLD: 4096}, _profile([OLD]))
            views[view.name] = view
        self.instances = Instances(views)
        self.policy: Policy = make_policy(
            "aegaeon", ClusterSpec(("prefill-0",), ("decode-0",)), _latency([OLD])
        )
        self.cache = Cache()
        self.sent: list[tuple[str, Message]] = []
        config = Config(models=(ModelConfig(OLD, Path("/m/old")),))
        self.models = ClusterModels(config, self.instances, self.cache,  # type: ignore[arg-type]
                                    lambda n, m: self.sent.append((n, m)), lambda: self.policy)

    def answer(self, name: str, serves: bool, tokens: int = 2048) -> None:
        """``name`` answers the last AddModel it was sent (echoing its ticket)."""
        view = self.instances.views[name]
        capacity = {OLD: 4096, **({NEW: tokens} if serves else {})}
        models = [OLD, NEW] if serves else [OLD]
        ticket = [m.ticket for n, m in self.sent if n == name and isinstance(m, AddModel)][-1]
        self.models.on_instance_models(
            InstanceModels(view.kind, view.index, 0, capacity, _profile(models), ticket=ticket)
        )


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_added_model_reaches_the_cachemgr_every_instance_and_the_policy() -> None:
    node = Node()
    task = asyncio.ensure_future(node.models.add(ModelConfig(NEW, Path("/m/new"))))
    await _settle()
    assert node.cache.calls == [RegisterModel(NEW, "/m/new")]
    assert sorted(n for n, _ in node.sent) == ["decode-0", "prefill-0"]
    assert all(isinstance(m, AddModel) and (m.name, m.path) == (NEW, "/m/new")
               for _, m in node.sent)  # fmt: skip
    assert len({m.ticket for _, m in node.sent if isinstance(m, AddModel)}) == 2
    node.answer("prefill-0", True)
    await _settle()
    assert not task.done()  # decode-0 has not answered
    node.answer("decode-0", True, tokens=1024)
    await asyncio.wait_for(task, 5)
    hello = node.instances.views["decode-0"].hello
    assert hello is not None and hello.capacity_tokens[NEW] == 1024  # the context bound
    latency: LatencyModel = node.policy.latency  # type: ignore[attr-defined]
    assert NEW in latency.specs  # prefill estimates for it
    assert node.policy.decode.capacity_tokens("decode-0", NEW) == 1024  # type: ignore[attr-defined]

    assert await node.models.forget(NEW) is True
    assert node.cache.calls[-1] == ForgetModel(NEW)
    assert NEW not in node.models.added


async def test_an_instance_that_cannot_read_the_model_fails_the_add() -> None:
    node = Node()
    task = asyncio.ensure_future(node.models.add(ModelConfig(NEW, Path("/m/new"))))
    await _settle()
    node.answer("prefill-0", True)
    node.answer("decode-0", False)  # it answered without the model (checkpoint error)
    with pytest.raises(BackendError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.status == 422 and "decode-0" in info.value.message


async def test_a_dead_instance_is_not_waited_for_and_its_successor_is_told() -> None:
    node = Node()
    node.instances.views["decode-0"].pid = None  # down
    task = asyncio.ensure_future(node.models.add(ModelConfig(NEW, Path("/m/new"))))
    await _settle()
    node.answer("prefill-0", True)
    await asyncio.wait_for(task, 5)
    node.sent.clear()
    # its successor says hello with the config's models only
    hello = InstanceHello("decode", 0, 200, 1, 1, 8, {OLD: 4096}, _profile([OLD]),
                          incarnation=7)  # fmt: skip
    view = node.instances.views["decode-0"]
    view.pid, view.hello = 200, hello
    node.models.on_hello(view, hello)
    await _settle()
    assert [(n, m.name) for n, m in node.sent if isinstance(m, AddModel)] == [("decode-0", NEW)]
    assert node.cache.calls[-1] == RegisterModel(NEW, "/m/new")

    # a configured model removed here is forgotten again after a restart
    await node.models.forget(OLD)
    node.sent.clear()
    restarted = msgspec.structs.replace(hello, capacity_tokens={OLD: 1, NEW: 1}, incarnation=8)
    node.models.on_hello(view, restarted)
    await _settle()
    assert node.cache.calls[-1] == ForgetModel(OLD) and node.sent == []
    # and only once: the same process's later hellos (one per heartbeat) resend nothing
    calls = len(node.cache.calls)
    node.models.on_hello(view, restarted)
    await _settle()
    assert len(node.cache.calls) == calls and node.sent == []


def test_policy_is_built_before_adds() -> None:
    node = Node()
    node.policy = None  # type: ignore[assignment]

    async def main() -> None:
        with pytest.raises(BackendError) as info:
            await node.models.add(ModelConfig(NEW, Path("/m/new")))
        assert info.value.status == 503

    asyncio.run(main())
