"""``aegaeon plan`` for GPU nodes that are not here (``--assume-gpus``): a working split on a
24, 40, 48 and 80 GB card, and tensor-parallel groups on 8 x 80 GB for a 70B market.

"Working": the written config validates; on each GPU the instances' device memory plus
what the GPU keeps back fits the card; every instance holds the largest model (its
shard, with TP) and at least 1 GiB of KV; the Model Cache and the CPU KV cache fit the
cachemgr's /dev/shm; compose's AEGAEON_SHM_SIZE and AEGAEON_START_PERIOD are printed.
Sizes in GB are decimal (a "24 GB" card: 22.4 GiB), below what such cards report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from aegaeon_cli.main import main
from aegaeon_common.config import load_config
from aegaeon_market.presets import preset_config, preset_named
from aegaeon_sched.placement import GpuInfo, gpu_reserve_bytes
from cli_support import config_market

GiB = 1 << 30
L8B = preset_config(preset_named("llama-3.1-8b"), "bfloat16")
L70B = {**L8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "intermediate_size": 28672}  # Llama 3.1 70B's config.json  # fmt: skip
MARKETS: dict[str, dict[str, dict[str, Any]]] = {
    "3b": {"llama-3.2-3b": preset_config(preset_named("llama-3.2-3b"), "bfloat16"),
           "llama-3.2-1b": preset_config(preset_named("llama-3.2-1b"), "bfloat16")},
    "8b": {"llama-3.1-8b": L8B,
           "qwen2.5-7b": preset_config(preset_named("qwen2.5-7b"), "bfloat16")},
    "70b": {"llama-3.1-70b": L70B, "llama-3.1-8b": L8B},
}  # fmt: skip


def _market(root: Path, name: str) -> Path:
    return config_market(root / name, MARKETS[name])


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], market: str,
          *args: str) -> tuple[str, dict[str, Any]]:  # fmt: skip
    out = tmp_path / "planned.yaml"
    code = main(["plan", "--market", str(_market(tmp_path, market)), *args, "--write", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    return printed.out, yaml.safe_load(out.read_text())


def _check_working(planned: dict[str, Any], path: Path, card_bytes: int, shm_bytes: int,
                   largest_per_gpu: int) -> None:  # fmt: skip
    path.write_text(yaml.safe_dump(planned))
    config = load_config(path)  # the workers read and validate exactly this
    per_gpu: dict[str, int] = {}
    instances = 0
    for section in (config.prefill, config.decode):
        for i in range(section.instances):
            for device in section.group_devices(i):
                per_gpu[device] = per_gpu.get(device, 0) + section.device_memory_bytes
                instances += 1
        weights = section.device_memory_bytes - section.kv_memory_bytes
        assert weights >= largest_per_gpu and section.kv_memory_bytes >= GiB - 64 * (1 << 20)
    for device, used in per_gpu.items():
        on = sum(1 for s in (config.prefill, config.decode) for i in range(s.instances)
                 if device in s.group_devices(i))  # fmt: skip
        gpu = GpuInfo(0, "card", card_bytes, card_bytes)
        assert used + gpu_reserve_bytes(gpu, on) <= card_bytes, device
    assert config.cache.model_cache_bytes + config.cache.kv_cache_bytes <= 0.9 * shm_bytes


@pytest.mark.parametrize(("card", "market", "largest"), [
    ("24GB", "3b", "llama-3.2-3b"), ("40GB", "8b", "llama-3.1-8b"),
    ("48GB", "8b", "llama-3.1-8b"), ("80GB", "8b", "llama-3.1-8b"),
])  # fmt: skip
def test_a_single_gpu_node_gets_a_working_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], card: str, market: str, largest: str
) -> None:
    from aegaeon_common.config_parse import parse_bytes
    from aegaeon_engine import ModelSpec, weight_layout

    printed, planned = _plan(tmp_path, capsys, market, "--assume-gpus", card,
                             "--assume-memory", "256GB", "--shm-size", "64g")  # fmt: skip
    # one prefill and one decode instance share the one GPU, sized once for both
    assert planned["prefill"]["devices"] == planned["decode"]["devices"] == ["cuda:0"]
    assert planned["prefill"]["instances"] == planned["decode"]["instances"] == 1
    assert "-> prefill-0, decode-0" in printed
    spec = ModelSpec.from_dir(tmp_path / market / largest)
    _check_working(planned, tmp_path / "check.yaml", parse_bytes(card), 64 * GiB,
                   weight_layout(spec, "bfloat16").total_bytes)  # fmt: skip
    assert "compose (.env): AEGAEON_SHM_SIZE=" in printed and "AEGAEON_START_PERIOD=" in printed


def test_a_24gb_card_refuses_an_8b_market_and_says_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code = main(["plan", "--market", str(_market(tmp_path, "8b")), "--assume-gpus", "24GB",
                 "--assume-memory", "256GB", "--shm-size", "64g"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "does not fit prefill-0 on cuda:0 (assumed 24GB GPU)" in err and "shared by 2" in err


def test_eight_80gb_gpus_serve_70b_with_tensor_parallel_groups(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    printed, planned = _plan(tmp_path, capsys, "70b", "--assume-gpus", "8x80GB",
                             "--assume-memory", "2TB", "--shm-size", "1t")  # fmt: skip
    # the smallest size whose shard fits: 4 (2 ways is 67.7 GiB per GPU, over 67 GiB)
    assert planned["prefill"]["tp"] == planned["decode"]["tp"] == 4
    assert planned["prefill"]["devices"] == [f"cuda:{i}" for i in range(4)]
    assert planned["decode"]["devices"] == [f"cuda:{i}" for i in range(4, 8)]
    assert "prefill x1 (tensor parallel, 4 GPUs each)" in printed
    assert "cuda:5 assumed 80GB GPU" in printed and "-> decode-0 rank 1" in printed
    from aegaeon_engine import ModelSpec
    from aegaeon_engine.tp_layout import tp_layout

    shards = tp_layout(ModelSpec.from_dir(tmp_path / "70b" / "llama-3.1-70b"), 4, "bfloat16")
    _check_working(planned, tmp_path / "check.yaml", 80 * 10**9, 1 << 40,
                   max(s.total_bytes for s in shards.shards))  # fmt: skip
    # the Model Cache holds the shards (their embeddings once per shard)
    assert planned["cachemgr"]["model_cache"] >= shards.total_bytes
    # a size given is kept: 8 GPUs per instance, prefill and decode sharing them
    printed, planned = _plan(tmp_path / "tp8", capsys, "70b", "--assume-gpus", "8x80GB",
                             "--assume-memory", "2TB", "--shm-size", "1t", "--tp", "8")
    assert planned["prefill"]["devices"] == planned["decode"]["devices"]
    assert len(planned["decode"]["devices"]) == 8 and planned["decode"]["tp"] == 8
    # and so is the config file's `instance.tp` (both roles' size)
    config = tmp_path / "tp8-config.yaml"
    config.write_text(f"market: {tmp_path / '70b'}\ninstance: {{tp: 8}}\n")
    out = tmp_path / "tp8-config-planned.yaml"
    assert main(["plan", "--config", str(config), "--assume-gpus", "8x80GB", "--assume-memory",
                 "2TB", "--shm-size", "1t", "--write", str(out)]) == 0, capsys.readouterr().err
    planned = yaml.safe_load(out.read_text())
    assert planned["prefill"]["tp"] == planned["decode"]["tp"] == 8


def test_a_tensor_parallel_size_that_does_not_fit_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    code = main(["plan", "--market", str(_market(tmp_path, "70b")), "--assume-gpus", "8x80GB",
                 "--assume-memory", "2TB", "--shm-size", "1t", "--tp", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "llama-3.1-70b (131.4 GiB in bfloat16, 67.7 GiB per GPU split 2 ways)" in err
    code = main(["plan", "--market", str(tmp_path / "70b"), "--assume-gpus", "2x80GB",
                 "--assume-memory", "2TB", "--shm-size", "1t"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "tensor parallelism over 2 GPUs does not fit either" in err
    for bad in ("8x", "x80GB", "0x80GB", "8x1MB"):
        assert main(["plan", "--market", str(tmp_path / "70b"), "--assume-gpus", bad]) == 2
        assert "--assume-gpus" in capsys.readouterr().err
