"""``--gpus``'s facts and wiring (aegaeon_cli.machine, ``aegaeon plan``, serve's
parse stage), with the GPUs faked: no torch, no CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from aegaeon_cli import machine
from aegaeon_cli.main import main
from aegaeon_common.config import config_from_dict, load_config
from aegaeon_market.presets import preset_config, preset_named
from aegaeon_sched.placement import GpuInfo, HostInfo, PlacementError
from cli_support import config_market, serve_args

GiB = 1 << 30
H100 = [GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 * GiB, 79 * GiB) for i in range(4)]


@pytest.fixture
def market(tmp_path: Path) -> Path:
    """Two real-shaped 7-8B models: their config.json only (sizing reads no weights)."""
    return config_market(tmp_path / "market", {
        name: preset_config(preset_named(name), "bfloat16")
        for name in ("llama-3.1-8b", "qwen2.5-7b")})


@pytest.fixture
def fake_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_gpus", lambda: list(H100))
    monkeypatch.setattr(machine, "host_info", lambda: HostInfo(512 * GiB, 256 * GiB))


def test_host_info_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   32768000 kB\n")
    host = machine.host_info(meminfo, shm=tmp_path)
    assert host.mem_available_bytes == 32768000 * 1024 and host.shm_free_bytes is not None
    assert machine.host_info(meminfo, shm=tmp_path / "absent").shm_free_bytes is None
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(PlacementError, match="no MemAvailable"):
        machine.host_info(meminfo)


def test_model_bytes_are_the_packed_layouts(market: Path) -> None:
    config = config_from_dict({"market": str(market)})
    assert machine.model_bytes(config) == {"llama-3.1-8b": 16_060_522_496,
                                           "qwen2.5-7b": 15_231_233_024}  # fmt: skip


def test_explicit_counts() -> None:
    assert machine.explicit_counts({}) == (None, None)
    assert machine.explicit_counts({"prefill": {"instances": 2}, "decode": None}) == (2, None)


@pytest.mark.usefixtures("fake_machine")
def test_sized_places_the_config_on_the_gpus(market: Path) -> None:
    raw = {"market": str(market), "decode": {"instances": 3, "http_port": 9300}}
    config, out, plan = machine.sized(raw, config_from_dict(raw), "all", (None, 3))
    assert config.prefill.devices == ("cuda:0",)
    assert config.decode.devices == ("cuda:1", "cuda:2", "cuda:3")
    assert config.decode.http_port == 9300 and out["decode"]["instances"] == 3
    assert plan.cache is not None and plan.cache.holds_all
    assert config.cache.model_cache_bytes == plan.cache.models_bytes >= 31_291_755_520


@pytest.mark.usefixtures("fake_machine")
def test_a_container_plans_its_own_part(market: Path) -> None:
    raw = {"market": str(market), "prefill": {"instances": 1}, "decode": {"instances": 1}}
    config = config_from_dict(raw)
    _, out, plan = machine.sized(raw, config, "all", (1, 1), only="decode")
    assert [i.name for i in plan.instances] == ["decode-0"] and plan.cache is None
    assert out["decode"]["devices"] == ["cuda:0"] and out["prefill"] == {"instances": 1}
    _, out, plan = machine.sized(raw, config, None, (1, 1), only="cachemgr")
    assert not plan.instances and plan.cache is not None
    assert out["cachemgr"]["model_cache"] == plan.cache.model_cache_bytes


@pytest.mark.usefixtures("fake_machine")
def test_aegaeon_plan_prints_and_writes_the_config(
    market: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "planned.yaml"
    assert main(["plan", "--market", str(market), "--gpus", "0,1", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("GPU plan (--gpus 0,1):")
    assert "prefill x1: device memory 71.0 GiB each" in printed
    assert out.read_text().startswith("# GPU plan (--gpus 0,1):")
    config = load_config(out)
    assert config.prefill.device_of(0) == "cuda:0" and config.decode.device_of(0) == "cuda:1"
    assert yaml.safe_load(out.read_text())["market"] == str(market)


def test_aegaeon_plan_errors_are_one_line(market: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    def no_gpu() -> list[GpuInfo]:
        raise PlacementError("--gpus: no CUDA GPU visible to torch")

    monkeypatch.setattr(machine, "cuda_gpus", no_gpu)
    assert main(["plan", "--market", str(market), "--gpus", "all"]) == 2
    assert capsys.readouterr().err == "aegaeon plan: --gpus: no CUDA GPU visible to torch\n"


def test_serve_refuses_a_bad_spec_before_anything_starts(
    market: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["serve", "--market", str(market), "--run-dir", str(run_dir), "--gpus", "1,1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == "aegaeon serve: --gpus 1,1: GPU 1 is listed twice"
    assert not run_dir.exists()


# ---- --device-memory: a cap per instance ------------------------------------------------
def test_the_cap_sizes_the_arena_and_kv_inside_it(market: Path, tmp_path: Path) -> None:
    """``serve --device-memory GiB``: every instance's buffer is the cap, the arena two of the
    largest model (16.06 GB in bf16) and the KV region the rest; on a CPU the instance
    then copies weights into its arena instead of mapping them."""
    from aegaeon_cli.serve import _effective_config
    from aegaeon_sched.sizing import split_buffer

    path = tmp_path / "c.yaml"
    path.write_text(f"market: {market}\ndecode: {{kv_memory: 64MiB, weights: auto}}\n")
    args = serve_args(path, run_dir=tmp_path / "run", device_memory=40.0)
    config, raw, plan = _effective_config(args)
    largest = max(machine.model_bytes(config).values())
    assert plan is None
    for inst in (config.prefill, config.decode):
        assert 40 * GiB - (64 << 20) < inst.device_memory_bytes <= 40 * GiB  # KV in 64 MiB
        arena = inst.device_memory_bytes - inst.kv_memory_bytes
        assert 2 * largest <= arena < 2 * largest + 128 << 20  # two: active + prefetched
        assert inst.kv_memory_bytes >= 40 * GiB // 4 and inst.weights == "copy"
        assert inst.adapter_region_bytes == 0  # no LoRA adapter served: the arena is whole
    assert raw["decode"] == {"weights": "copy",
                             "device_memory": config.decode.device_memory_bytes,
                             "kv_memory": config.decode.kv_memory_bytes}
    # smaller: the largest model once (no prefetch room) while it leaves 64 MiB of KV
    once = split_buffer(int(18 * GiB), largest, 64 << 20)
    assert once is not None and not once.prefetch_room and once.weights_bytes < 2 * largest
    config, _, _ = _effective_config(serve_args(path, run_dir=tmp_path / "run",
                                                     device_memory=18.0))
    assert config.decode.kv_memory_bytes == once.kv_memory_bytes


def test_a_cap_too_small_is_one_line_and_nothing_starts(
        market: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    argv = ["serve", "--market", str(market), "--run-dir", str(run_dir), "--device-memory",
            "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aegaeon serve: --device-memory 8.0 GiB: the largest model "
                          "llama-3.1-8b (15.0 GiB in bfloat16)"), err
    assert "\n" not in err and not run_dir.exists()
    for bad in ("0", "-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--market", str(market), "--device-memory", bad])
        assert info.value.code == 2
        assert "--device-memory" in capsys.readouterr().err


def test_adapters_are_sized_by_their_bytes_and_their_region_comes_out_of_kv(
        market: Path) -> None:
    """A served LoRA adapter counts its own A and B (megabytes), and an instance that
    copies weights keeps its adapter region (1/16 of its device memory, or its own
    ``adapter_memory``) beside an arena sized as without adapters: the KV gives way."""
    from aegaeon_engine import ModelSpec
    from aegaeon_engine.lora_spec import AdapterSpec, adapter_layout
    from aegaeon_market.adapters import add_random_adapter
    from aegaeon_sched.sizing import cap_split

    entry = add_random_adapter(market, "tuned", "llama-3.1-8b", 8)
    raw = {"market": str(market)}
    config = config_from_dict(raw)
    sizes = machine.model_bytes(config)
    spec = AdapterSpec.from_dir(entry.path, ModelSpec.from_dir(market / "llama-3.1-8b"))
    assert sizes["tuned"] == adapter_layout(spec, "bfloat16").total_bytes < 64 << 20
    bases = {n: b for n, b in sizes.items() if n != "tuned"}
    for given, want in ((None, None), ("256MiB", 256 << 20)):
        raw = {"market": str(market),
               **({"decode": {"adapter_memory": given}} if given else {})}
        capped, _, _ = machine.capped(raw, config_from_dict(raw), 40 * GiB)
        for inst in (capped.prefill, capped.decode):
            split = cap_split(40 * GiB, bases, "bfloat16", "cpu")
            region = inst.adapter_region_bytes
            mine = want if inst is capped.decode and want else split.device_memory_bytes // 16
            assert region == mine // (1 << 20) * (1 << 20) > 0
            arena = inst.device_memory_bytes - inst.kv_memory_bytes - region
            assert arena == split.weights_bytes
    tiny = {"market": str(market), "decode": {"adapter_memory": "39GiB"}}
    with pytest.raises(PlacementError, match="adapter_memory"):
        machine.capped(tiny, config_from_dict({"market": str(market)}), 40 * GiB)


@pytest.mark.usefixtures("fake_machine")
def test_with_gpus_the_cap_bounds_each_share(market: Path) -> None:
    raw = {"market": str(market), "prefill": {"instances": 1}, "decode": {"instances": 1}}
    _, _, free = machine.sized(raw, config_from_dict(raw), "0", (1, 1))
    _, _, capped = machine.sized(raw, config_from_dict(raw), "0", (1, 1), cap_bytes=30 * GiB)
    for kind in ("prefill", "decode"):  # two instances share one H100: ~35.5 GiB each
        full, cap = free.kind(kind), capped.kind(kind)
        assert full is not None and cap is not None
        assert cap.device_memory_bytes <= 30 * GiB < full.device_memory_bytes
        assert cap.weights_bytes == full.weights_bytes  # the KV region gave way
    with pytest.raises(PlacementError, match=r"--device-memory caps it at 16\.0 GiB"):
        machine.sized(raw, config_from_dict(raw), "0", (1, 1), cap_bytes=16 * GiB)
