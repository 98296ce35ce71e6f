"""An instance's registry record follows what it serves: the models added at run time
(with the latency profile over them) and the models on its device, each beat."""

from __future__ import annotations

from pathlib import Path

import msgspec
from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.messages.report import InstanceHello, InstanceStats
from aegaeon_common.registry import decode_instance, instance_key
from aegaeon_common.store import MemoryStore
from aegaeon_runtime.registrar import Registrar
from fake_worker import latency_profile


async def test_the_record_lists_added_models_and_the_models_on_the_device(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    config = Config(models=(ModelConfig("a", tmp_path / "a"),), run_dir=tmp_path)
    hello = InstanceHello("prefill", 0, 42, 1, 1, 8, {"a": 100}, latency_profile(["a"]))
    registrar = Registrar(config, store, hello, "http://127.0.0.1:1")

    async def record(stats: InstanceStats) -> tuple[list[str], list[str], list[str], int]:
        await registrar.beat(stats)
        raw = await store.get(instance_key(registrar.instance_id))
        assert raw is not None
        r = decode_instance(raw)
        assert r.latency is not None
        return r.models, sorted(r.latency.models), r.load.resident_models, \
            r.load.residency_version  # fmt: skip

    stats = InstanceStats("prefill", 0, "a", 0, 0, resident_models=["a"], residency_version=3)
    assert await record(stats) == (["a"], ["a"], ["a"], 3)
    registrar.serve(msgspec.structs.replace(hello, capacity_tokens={"a": 100, "b": 50},
                                            latency=latency_profile(["a", "b"])))  # fmt: skip
    asleep = msgspec.structs.replace(stats, resident_models=[], residency_version=4)
    assert await record(asleep) == (["a", "b"], ["a", "b"], [], 4)


async def test_a_draining_instance_hears_nothing_more_once_no_replica_is_listed(
    tmp_path: Path,
) -> None:
    """(``aegaeon_runtime.service._drain``: no replica answers a drain; each takes itself
    off the list as it leaves, and an empty list ends the wait for an answer.)"""
    from aegaeon_common.registry import PROXIES
    from aegaeon_common.store import StoreError

    store = MemoryStore()
    config = Config(models=(ModelConfig("a", tmp_path / "a"),), run_dir=tmp_path)
    hello = InstanceHello("decode", 0, 42, 1, 1, 8, {"a": 100}, latency_profile(["a"]))
    registrar = Registrar(config, store, hello, "http://127.0.0.1:1")
    await store.set_add(PROXIES, "replica-0")
    await store.set_add(PROXIES, "replica-1")
    assert not await registrar.no_replica()
    await store.set_remove(PROXIES, "replica-0")
    assert not await registrar.no_replica()  # one may still send
    await store.set_remove(PROXIES, "replica-1")
    assert await registrar.no_replica()

    async def unreachable(name: str) -> set[str]:
        raise StoreError("down")

    registrar.store.set_members = unreachable  # type: ignore[method-assign]
    assert not await registrar.no_replica()  # a store that does not answer proves nothing
