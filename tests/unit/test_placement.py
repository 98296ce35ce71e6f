"""``--gpus``: the spec, placement and sizing (aegaeon_sched.placement, .sizing), pure."""

from __future__ import annotations

from pathlib import Path

import pytest
from aegaeon_common.config import ConfigError, config_from_dict
from aegaeon_sched.gpu_spec import parse_gpus, select_gpus
from aegaeon_sched.placement import (
    GpuInfo,
    HostInfo,
    PlacementError,
    Plan,
    default_counts,
    gpu_reserve_bytes,
)
from aegaeon_sched.plan_config import apply_plan
from aegaeon_sched.sizing import KV_MIN_BYTES, plan_cache, plan_node

GiB = 1 << 30
MiB = 1 << 20
B8 = 16_060_522_496  # llama-3.1-8b in bfloat16 (its packed layout)
B70 = 141_107_412_992  # llama-3.1-70b in bfloat16
MODELS_8B = {"llama-3.1-8b": B8, "qwen2.5-7b": 15_231_233_024, "small": 1 * GiB}
HOST = HostInfo(mem_available_bytes=1000 * GiB, shm_free_bytes=500 * GiB)


def h100(index: int, free_gib: float = 79.0) -> GpuInfo:
    return GpuInfo(index, "NVIDIA H100 80GB HBM3", 80 * GiB, int(free_gib * GiB))


def machine(n: int) -> list[GpuInfo]:
    return [h100(i) for i in range(n)]


Counts = tuple[int | None, int | None]


def plan(
    gpus: list[GpuInfo],
    spec: str = "all",
    counts: Counts = (None, None),
    models: dict[str, int] | None = None,
    host: HostInfo | None = HOST,
) -> Plan:
    return plan_node(spec, gpus, host, counts, models or MODELS_8B, "bfloat16")


# ---- the spec ---------------------------------------------------------------------------------
def test_parse_gpus_all_and_lists() -> None:
    assert parse_gpus("all") is None and parse_gpus(" ALL ") is None
    assert parse_gpus("0,2") == (0, 2)
    assert parse_gpus(" 3 , 1 ") == (3, 1)


@pytest.mark.parametrize(("spec", "says"), [
    ("", "empty"), ("0,0", "GPU 0 is listed twice"), ("-1", "-1 is negative"),
    ("a", "'a' is not a GPU index"), ("1,,2", "'' is not a GPU index"), ("0;1", "not a GPU"),
])  # fmt: skip
def test_bad_specs_say_why(spec: str, says: str) -> None:
    with pytest.raises(PlacementError, match=says):
        parse_gpus(spec)


def test_select_names_what_the_machine_lacks() -> None:
    with pytest.raises(PlacementError, match=r"GPU 2 is not on this machine \(it has 0, 1\)"):
        select_gpus("0,2", machine(2))
    with pytest.raises(PlacementError, match="no CUDA GPU on this machine"):
        select_gpus("all", [])
    assert [g.index for g in select_gpus("3,1", machine(4))] == [3, 1]


def test_default_counts() -> None:
    assert default_counts(1, None, None) == (1, 1)  # one GPU: one of each, sharing it
    assert default_counts(2, None, None) == (1, 1)
    assert default_counts(3, None, None) == (1, 2)  # the odd GPU decodes
    assert default_counts(8, None, None) == (4, 4)
    assert default_counts(8, 2, None) == (2, 6) and default_counts(8, None, 5) == (3, 5)
    assert default_counts(1, 3, 2) == (3, 2)  # the config's counts win
    with pytest.raises(PlacementError, match="at least one"):
        default_counts(2, 0, 0)


# ---- placement and device sizes ---------------------------------------------------------------
def test_one_gpu_is_shared_by_a_prefill_and_a_decode_instance() -> None:
    p = plan(machine(1))
    assert [(i.name, i.gpu.device, i.sharing) for i in p.instances] == [
        ("prefill-0", "cuda:0", 2),
        ("decode-0", "cuda:0", 2),
    ]
    prefill, decode = p.kind("prefill"), p.kind("decode")
    assert prefill is not None and decode is not None
    usable = 79 * GiB - gpu_reserve_bytes(h100(0), 2)
    assert prefill.device_memory_bytes <= usable // 2 and decode == prefill.__class__(
        "decode",
        ("cuda:0",),
        prefill.device_memory_bytes,
        prefill.kv_memory_bytes,
        prefill.weights_bytes,
        prefill.prefetch_room,
    )
    # half an H100 less its reserve: one 8B model and its KV, no room for a second
    assert not prefill.prefetch_room and prefill.weights_bytes >= B8
    assert prefill.kv_memory_bytes >= 10 * GiB and prefill.kv_memory_bytes % (64 * MiB) == 0
    assert prefill.weights_bytes + prefill.kv_memory_bytes == prefill.device_memory_bytes


def test_two_gpus_one_instance_each_with_room_to_prefetch() -> None:
    p = plan(machine(2))
    assert [(i.name, i.gpu.device, i.sharing) for i in p.instances] == [
        ("prefill-0", "cuda:0", 1),
        ("decode-0", "cuda:1", 1),
    ]
    decode = p.kind("decode")
    assert decode is not None and decode.devices == ("cuda:1",)
    assert decode.prefetch_room and decode.weights_bytes >= 2 * B8
    assert decode.device_memory_bytes <= 79 * GiB - 8 * GiB  # 10% of 80 GiB kept back
    assert decode.device_memory_bytes > 70 * GiB


def test_eight_gpus_four_prefill_four_decode() -> None:
    p = plan(machine(8))
    prefill, decode = p.kind("prefill"), p.kind("decode")
    assert prefill is not None and decode is not None
    assert prefill.devices == tuple(f"cuda:{i}" for i in range(4))
    assert decode.devices == tuple(f"cuda:{i}" for i in range(4, 8))
    assert all(i.sharing == 1 for i in p.instances) and not p.unused


def test_heterogeneous_free_memory_sizes_a_kind_by_its_tightest_gpu() -> None:
    gpus = [h100(0, 79), h100(1, 40), h100(2, 79), h100(3, 60)]
    p = plan(gpus)
    prefill, decode = p.kind("prefill"), p.kind("decode")
    assert prefill is not None and decode is not None
    assert prefill.device_memory_bytes <= 40 * GiB - 8 * GiB  # cuda:1's share bounds prefill
    assert 60 * GiB - 8 * GiB - 64 * MiB <= decode.device_memory_bytes <= 60 * GiB - 8 * GiB
    assert "cuda:1 NVIDIA H100 80GB HBM3: 40.0 GiB free of 80.0 GiB" in p.describe()


def test_a_subset_of_gpus_and_the_unused_ones() -> None:
    p = plan(machine(4), spec="0,2")
    assert [i.gpu.device for i in p.instances] == ["cuda:0", "cuda:2"]
    p = plan(machine(4), counts=(1, 1))
    assert [g.index for g in p.unused] == [2, 3]
    assert "cuda:3 NVIDIA H100 80GB HBM3: unused" in p.describe()


def test_more_instances_than_gpus_go_round_and_share() -> None:
    p = plan(machine(2), counts=(2, 2))
    assert [(i.name, i.gpu.index, i.sharing) for i in p.instances] == [
        ("prefill-0", 0, 2),
        ("prefill-1", 1, 2),
        ("decode-0", 0, 2),
        ("decode-1", 1, 2),
    ]


def test_a_model_larger_than_a_gpu_is_an_error_naming_it() -> None:
    with pytest.raises(PlacementError) as err:
        plan(machine(2), models={"llama-3.1-70b": B70, "small": GiB})
    text = str(err.value)
    assert "llama-3.1-70b (131.4 GiB in bfloat16) does not fit prefill-0 on cuda:0" in text
    assert "79.0 GiB free of 80.0 GiB" in text and "it needs 132.5 GiB" in text


def test_a_model_that_fits_one_gpu_alone_but_not_shared() -> None:
    models = {"big": 40 * GiB}
    assert plan(machine(2), models=models).kind("decode") is not None
    with pytest.raises(PlacementError, match="shared by 2 instances"):
        plan(machine(1), models=models)


def test_the_kv_region_never_falls_below_its_minimum() -> None:
    for free in (20, 30, 45, 79):
        try:
            p = plan([GpuInfo(0, "g", 48 * GiB, free * GiB)], models={"m": 14 * GiB})
        except PlacementError:
            continue
        for kind in p.kinds:
            assert kind.kv_memory_bytes >= KV_MIN_BYTES - 64 * MiB


# ---- the host ---------------------------------------------------------------------------------
def test_the_model_cache_holds_the_market_when_the_host_can() -> None:
    cache = plan_cache(HOST, MODELS_8B, "bfloat16")
    assert cache.holds_all and cache.model_cache_bytes >= sum(MODELS_8B.values())
    assert cache.kv_cache_bytes == 64 * GiB  # a quarter of 500 GiB, capped


def test_a_small_host_caps_the_model_cache_and_says_so() -> None:
    host = HostInfo(mem_available_bytes=48 * GiB, shm_free_bytes=None)  # budget 24 GiB
    models = {f"m{i}": B8 for i in range(4)}
    cache = plan_cache(host, models, "bfloat16")
    assert not cache.holds_all and cache.kv_cache_bytes == 6 * GiB
    assert B8 <= cache.model_cache_bytes <= 18 * GiB
    p = plan(machine(2), models=models, host=host)
    assert "capped: the models need 59.9 GiB" in p.describe()


def test_dev_shm_bounds_the_budget_and_the_cpu_kv_cache_gives_way() -> None:
    host = HostInfo(mem_available_bytes=200 * GiB, shm_free_bytes=20 * GiB)  # budget 18 GiB
    cache = plan_cache(host, {"m": 15 * GiB}, "bfloat16")
    assert cache.budget_bytes == int(18 * GiB) and cache.kv_cache_bytes == GiB
    with pytest.raises(PlacementError, match=r"too small for the largest model m \(20.0 GiB"):
        plan_cache(host, {"m": 20 * GiB}, "bfloat16")


# ---- the config it makes ----------------------------------------------------------------------
def _raw(tmp_path: Path, **sections: object) -> dict[str, object]:
    return {"models": [{"name": n, "path": str(tmp_path / n)} for n in MODELS_8B], **sections}


def test_apply_plan_sets_devices_and_sizes_and_keeps_the_rest(tmp_path: Path) -> None:
    p = plan(machine(2))
    raw = _raw(
        tmp_path,
        prefill={"device_memory": "32GiB", "http_port": 9200, "threads": 2},
        cachemgr={"model_cache": "24GiB", "slab": "4MiB"},
    )
    config = config_from_dict(apply_plan(raw, p))
    assert config.prefill.devices == ("cuda:0",) and config.decode.device_of(0) == "cuda:1"
    assert config.prefill.http_port == 9200 and config.prefill.threads == 2
    assert config.prefill.device_memory_bytes == p.kinds[0].device_memory_bytes
    assert p.cache is not None and config.cache.model_cache_bytes == p.cache.model_cache_bytes
    assert config.cache.slab_bytes == 4 * MiB
    assert not config.prefill.maps_weights  # a GPU: scale-up copies
    assert raw["prefill"] == {"device_memory": "32GiB", "http_port": 9200, "threads": 2}


def test_apply_plan_for_unified_workers_gives_decode_every_device(tmp_path: Path) -> None:
    p = plan(machine(4))
    raw = _raw(tmp_path, scheduler={"policy": "request-level"})
    config = config_from_dict(apply_plan(raw, p, unified=True))
    assert config.decode.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert [config.decode.device_of(i) for i in range(4)] == list(config.decode.devices)


def test_devices_in_a_config(tmp_path: Path) -> None:
    config = config_from_dict(_raw(tmp_path, decode={"devices": ["cuda:1", "cuda:3"]}))
    assert [config.decode.device_of(i) for i in range(3)] == ["cuda:1", "cuda:3", "cuda:1"]
    assert config.prefill.device_of(5) == "cpu"  # no devices: every instance on `device`
    with pytest.raises(ConfigError, match="'map' needs a CPU device, not 'cuda:1'"):
        config_from_dict(_raw(tmp_path, decode={"devices": "cuda:1", "weights": "map"}))
